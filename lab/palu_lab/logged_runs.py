"""The lab's framework runs (palu_trainer.framework.launch's command lines) in a subprocess, logged to a
file: the miniature's stages and gpu-check's runs."""

import shlex
import subprocess
import time
from pathlib import Path


def run_logged(argv: list[str], log_path: Path, env: dict, cwd: Path | None = None) -> tuple[int, float]:
    """Run `argv` with its output in `log_path` (the command line first); (exit status, seconds)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log_path.open("w") as log:
        log.write(shlex.join(argv) + "\n\n")
        log.flush()
        result = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    return result.returncode, time.monotonic() - started


def log_tail(path: Path, lines: int = 30) -> str:
    return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])
