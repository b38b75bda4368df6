"""Step times and peak memory of one `palu-train` run, for `make gpu-check`.

With `PALU_RUN_STATS=1` in its environment, `palu-train` adds a TrainerCallback that writes
`run_stats_rank<R>.json` into the run's output folder when training ends: the seconds at the end of every
optimizer step (CUDA synchronised first), the process's peak GPU memory (`torch.cuda.max_memory_allocated`
over the whole process: model load, reference model or cache, training) and its peak resident memory.
With `PALU_CUDA_MEMORY_CAP_GIB` too, the process may allocate at most that much GPU memory
(`torch.cuda.set_per_process_memory_fraction`, set before the trainer moves the model to the GPU): a smaller
GPU on a larger one. Without the variables nothing changes.
"""

import json
import os
import resource
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

RUN_STATS_VARIABLE = "PALU_RUN_STATS"
MEMORY_CAP_VARIABLE = "PALU_CUDA_MEMORY_CAP_GIB"


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class RunStatsCallback(TrainerCallback):
    """Records when each optimizer step ends; writes them with the peak memory at the end of training."""

    def __init__(self, output_dir: str):
        self.output_dir = Path(output_dir)
        self.start = None
        self.step_ends: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        _synchronize()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _synchronize()
        self.step_ends.append(time.perf_counter() - self.start)

    def on_train_end(self, args, state, control, **kwargs):
        rank = int(os.environ.get("RANK", "0"))
        cuda = torch.cuda.is_available()
        stats = {
            "rank": rank,
            "steps": len(self.step_ends),
            "step_end_seconds": [round(seconds, 6) for seconds in self.step_ends],
            "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            # Linux reports ru_maxrss in KiB
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / f"run_stats_rank{rank}.json").write_text(json.dumps(stats, indent=1))
