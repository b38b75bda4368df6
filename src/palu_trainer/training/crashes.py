"""The ways a training run crashes that the run guard cannot see coming, each told in one line with its fix
(`crash_problem`); the crashed run's folder marked failed (`mark_failed`), so that palu-eval refuses it; and
DeepSpeed's CPU shared-memory buffers, which it never unlinks, released at every exit that Python sees and
after runs killed outright (`release_shared_memory`, `remove_stale_shared_memory`)."""

import json
import os
from pathlib import Path

MEMORY_FIXES = (
    "lower trainer.args.per_device_train_batch_size (raise gradient_accumulation_steps to keep the global "
    "batch), set trainer.args.gradient_checkpointing=true, train in bf16 (trainer.args.bf16=true), train "
    "LoRA adapters (+peft=lora), or for PALU keep its reference cache smaller "
    "(trainer.method_args.reference_cache_dtype=bfloat16, a lower reference_cache_top_m)"
)
OUT_OF_MEMORY = ("can't allocate memory", "out of memory", "DefaultCPUAllocator")
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "NCCL communicator was aborted",
    "DistNetworkError",
)
SHARED_MEMORY = Path("/dev/shm")
FAILED_RUN_FILE = "palu_run_failed.json"


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines() or [type(error).__name__])[0][:300]


def crash_problem(error: BaseException) -> str | None:
    """One line naming the crash `error` and its fix, for the crashes a user can fix; None for the others
    (a bug, whose traceback is what helps)."""
    text = str(error)
    if isinstance(error, MemoryError) or any(marker in text for marker in OUT_OF_MEMORY):
        return f"the run ran out of memory ({first_line(error)}): {MEMORY_FIXES}"
    if type(error).__name__ in ("DistBackendError", "DistNetworkError") or any(
        marker in text for marker in PEER_GONE
    ):
        return (
            f"another process of this run stopped ({first_line(error)}): its own output says why (a killed "
            "rank, memory, a node lost). Resume from the last checkpoint under the same launcher with "
            "+trainer.args.resume_from_checkpoint=true"
        )
    if isinstance(error, PermissionError | IsADirectoryError | NotADirectoryError) or (
        isinstance(error, OSError) and error.errno in (13, 30)  # EACCES, EROFS
    ):
        where = error.filename or "a file"
        return (
            f"{where} cannot be used: {error.strerror or first_line(error)}. Give this user access to it, or "
            "point the option or variable that names it elsewhere (span_annotations, paths.output_dir, "
            "HF_HOME, HF_DATASETS_CACHE)"
        )
    return None


def mark_crashed(output_dir, error: BaseException) -> str | None:
    """Mark the folder of a training run that `error` ended failed (`FAILED_RUN_FILE`, from the main
    process), so that palu-eval refuses it; returns `crash_problem`'s line for the error."""
    problem = crash_problem(error)
    if os.environ.get("RANK", "0") == "0" and output_dir:
        folder = Path(output_dir).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "reason": "crashed",
            "step": None,
            "message": problem or f"{type(error).__name__}: {first_line(error)}",
            "next": "Fix the cause, then resume from its last checkpoint or start over.",
        }
        (folder / FAILED_RUN_FILE).write_text(json.dumps(record, indent=1))
    return problem


def shared_memory_buffer(environ=os.environ) -> Path:
    """This rank's DeepSpeed CPU allreduce buffer (deepspeed_shm_comm), named by user, address, port, rank."""
    address, port, rank = (environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT", "RANK"))
    return SHARED_MEMORY / f"deepspeed_allreduce_buffer_{os.getuid()}_{address}_{port}_{rank}"


def release_shared_memory() -> None:
    """Unlink this rank's buffer: DeepSpeed 0.15 leaves it (66 MB of RAM a rank, until reboot)."""
    if "RANK" in os.environ:
        shared_memory_buffer().unlink(missing_ok=True)


def remove_stale_shared_memory() -> list[str]:
    """Unlink this user's DeepSpeed buffers that no live process maps: those of runs killed outright."""
    buffers = list(SHARED_MEMORY.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))
    if not buffers:
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(maxsplit=5)[-1] for line in maps.read_text().splitlines())
        except OSError:
            continue  # a process that ended, or another user's
    stale = [path for path in buffers if str(path) not in mapped]
    for path in stale:
        path.unlink(missing_ok=True)
    return [path.name for path in stale]
