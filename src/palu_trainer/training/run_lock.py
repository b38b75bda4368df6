"""One run per output folder: a run takes `paths.output_dir` with a lock file naming its host, process and
start, and a second run into that folder stops before loading and names the first. A lock whose process is
gone (same host, no such process) is taken over with a line saying so. Under several processes only the
main process (RANK 0) takes it: one lock per run, not per rank."""

import atexit
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = "palu_run.lock"


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def holder(record: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    return (
        f"process {record.get('pid')} on {record.get('host')}, started {started}: {record.get('command', '')}"
    )


def running_run(folder) -> str | None:
    """The run that holds `folder` and is still going (its process alive, or on another host, where that
    cannot be told), as `holder` says it; None when no run or a gone one holds it."""
    try:
        held = json.loads((Path(folder).expanduser() / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    if held.get("host") not in (None, socket.gethostname()) or (
        held.get("pid") and process_alive(held["pid"])
    ):
        return holder(held)
    return None


def take_output_folder(folder) -> str | None:
    """Take `folder` for this run (released when the process exits). Returns the problem when another live
    run holds it, else None."""
    if os.environ.get("RANK", "0") != "0":
        return None
    path = Path(folder).expanduser() / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
        "command": " ".join(sys.argv),
    }
    written = path.with_name(f"{LOCK_FILE}.{record['pid']}")
    written.write_text(json.dumps(record))
    try:
        for _ in range(2):
            try:
                os.link(written, path)  # atomic, and refused when the lock exists: never half a lock
            except FileExistsError:
                try:
                    held = json.loads(path.read_text())
                except (OSError, ValueError):
                    held = {}  # unreadable: held by nobody alive
                if held.get("pid") == record["pid"] and held.get("host") == record["host"]:
                    return None  # palu-train took it before Hydra started; its callback asks again
                if held.get("host") not in (None, record["host"]) or (
                    held.get("pid") and process_alive(held["pid"])
                ):
                    return (
                        f"paths.output_dir={path.parent} is in use by another run ({holder(held)}); two "
                        "runs into one folder would overwrite each other's model and log: choose another "
                        f"paths.output_dir, or delete {path} if that run is gone"
                    )
                logger.warning("took over %s from a run that is gone (%s)", path, holder(held))
                path.unlink(missing_ok=True)
                continue
            atexit.register(release, path, record["pid"])
            return None
    finally:
        written.unlink(missing_ok=True)
    return f"paths.output_dir={path.parent}: could not take {path}; delete it if no run uses the folder"


def release(path: Path, pid: int) -> None:
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass
