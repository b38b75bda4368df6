"""The crashes a user can fix, each told in one line with its fix; the crashed run's folder marked failed;
DeepSpeed's shared-memory buffers of runs that are gone removed."""

import errno
import json
import mmap
import os

import pytest

from palu_trainer.training import crashes
from palu_trainer.training.crashes import crash_problem, mark_crashed, remove_stale_shared_memory
from palu_trainer.training.run_folder import FAILED_RUN_FILE, failed_run_problem


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
            "to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)"
        ),
        MemoryError(),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)"),
    ],
)
def test_memory_exhaustion_names_the_settings_that_lower_memory(error):
    problem = crash_problem(error)
    assert problem.startswith("the run ran out of memory (")
    for setting in ("per_device_train_batch_size", "gradient_checkpointing=true", "+peft=lora", "bfloat16"):
        assert setting in problem
    assert "\n" not in problem


def test_a_lost_rank_and_an_unusable_file_are_one_line_each():
    peer = crash_problem(
        RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:3417"
        )
    )
    assert peer.startswith("another process of this run stopped ([../third_party/gloo")
    assert peer.endswith("+trainer.args.resume_from_checkpoint=true")
    denied = crash_problem(PermissionError(errno.EACCES, "Permission denied", "/data/spans.jsonl"))
    assert denied.startswith("/data/spans.jsonl cannot be used: Permission denied. Give this user access")
    read_only = crash_problem(OSError(errno.EROFS, "Read-only file system", "/cache/datasets/lock"))
    assert read_only.startswith("/cache/datasets/lock cannot be used: Read-only file system.")
    assert crash_problem(ValueError("a bug")) is None  # its traceback is what helps


def test_a_crashed_run_is_marked_failed_so_that_palu_eval_refuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert mark_crashed(tmp_path, MemoryError()).startswith("the run ran out of memory")
    assert not (tmp_path / FAILED_RUN_FILE).exists()  # the main process marks it
    monkeypatch.setenv("RANK", "0")
    mark_crashed(tmp_path, KeyError("forget"))
    record = json.loads((tmp_path / FAILED_RUN_FILE).read_text())
    assert record["reason"] == "crashed" and record["message"] == "KeyError: 'forget'"
    assert failed_run_problem("model", tmp_path) == (
        f"model={tmp_path} is a failed run's folder ({FAILED_RUN_FILE}: crashed); it holds no finished "
        "model. Fix the cause, then resume from its last checkpoint or start over."
    )


def test_only_the_shared_memory_buffers_no_live_process_maps_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(crashes, "SHARED_MEMORY", tmp_path)
    uid = os.getuid()
    stale = tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_29500_1"  # a run killed outright
    live = tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_29501_0"  # a running run's: mapped
    other = tmp_path / f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_29500_0"  # another user's
    for path in (stale, live, other):
        path.write_bytes(b"\0" * 4096)
    with live.open("r+b") as file, mmap.mmap(file.fileno(), 4096):
        assert remove_stale_shared_memory() == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
