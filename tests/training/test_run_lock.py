"""One run per output folder (issue 62 row 1): the lock file, a live holder refused and named, a dead one's
lock taken over, only RANK 0 locking, and the lock gone when the process exits; through both entry points:
tests/framework/test_framework_entry_point.py."""

import json
import logging
import os
import socket
import subprocess
import sys

from palu_trainer.training.run_lock import LOCK_FILE, take_output_folder


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def write_lock(folder, pid, host=None):
    record = {"host": host or socket.gethostname(), "pid": pid, "started": 0, "command": "palu-train run=A"}
    (folder / LOCK_FILE).write_text(json.dumps(record))


def test_a_run_takes_its_folder_and_a_second_run_is_refused_naming_the_first(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, sleeper.pid)
        problem = take_output_folder(tmp_path)
        assert problem.startswith(
            f"paths.output_dir={tmp_path} is in use by another run (process {sleeper.pid} on"
        )
        assert (
            "palu-train run=A" in problem
            and f"or delete {tmp_path / LOCK_FILE} if that run is gone" in problem
        )
    finally:
        sleeper.kill()
    write_lock(tmp_path, 12345, host="another-host")
    assert "is in use by another run (process 12345 on another-host" in take_output_folder(tmp_path)


def test_a_dead_runs_lock_is_taken_over_with_a_line_saying_so(tmp_path, caplog):
    pid = dead_pid()
    write_lock(tmp_path, pid)
    with caplog.at_level(logging.WARNING):
        assert take_output_folder(tmp_path) is None
    assert f"took over {tmp_path / LOCK_FILE} from a run that is gone (process {pid} on" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert sorted(path.name for path in tmp_path.iterdir()) == [LOCK_FILE]


def test_only_the_main_process_locks_and_the_lock_goes_with_the_process(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert take_output_folder(tmp_path) is None and not (tmp_path / LOCK_FILE).exists()
    script = (
        "import sys, pathlib; from palu_trainer.training.run_lock import take_output_folder, LOCK_FILE; "
        "assert take_output_folder(sys.argv[1]) is None; "
        "assert (pathlib.Path(sys.argv[1]) / LOCK_FILE).is_file()"
    )
    monkeypatch.setenv("RANK", "0")
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True)
    assert not (tmp_path / LOCK_FILE).exists()
