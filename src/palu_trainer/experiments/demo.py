"""`make demo`: an offline miniature of the paper's TOFU experiment, through open-unlearning's entry points.

Stages: data (synthetic, or a subset of real TOFU) → tokenizer and tiny Llama from scratch → finetune
Original on `full` and Retain on the retain split (cached by a hash of data, model and hyperparameters)
→ evaluate Retain, then Original, with the stock TOFU evaluator → unlearn Original with every method on
a shared learning-rate grid, evaluating each → `summary.md`, `summary.json` and a plot (palu_trainer.report).
Every training and evaluation is a subprocess running the framework's own train.py / eval.py.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import OmegaConf

from palu_trainer.benchmarks.hf_dir import read_jsonl
from palu_trainer.benchmarks.synthetic_tofu import synthetic_benchmark
from palu_trainer.benchmarks.tofu_format import IDK_ANSWERS, TofuBenchmark
from palu_trainer.benchmarks.tofu_subset import make_tofu_subset
from palu_trainer.experiments import report
from palu_trainer.experiments.methods import METHODS, side_by_side_methods, tofu_overrides
from palu_trainer.experiments.tiny import save_tiny_model
from palu_trainer.framework.checkout import CONFIG_DIR, PROJECT_ROOT
from palu_trainer.framework.plugin import trainer_config
from palu_trainer.method.losses import resolve_top_k


@dataclass(frozen=True)
class Size:
    """How big each part of the demo is; `fast` is the ≤ 2 minute variant the test runs."""

    num_authors: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    finetune_epochs: int
    finetune_learning_rate: float
    unlearn_epochs: int
    unlearn_batch_size: int
    learning_rates: tuple[float, ...]
    max_new_tokens: int


SIZES = {
    "full": Size(40, 128, 2, 4096, 25, 3e-3, 10, 8, (3e-4, 1e-3, 3e-3), 48),
    "fast": Size(16, 64, 2, 1024, 30, 5e-3, 5, 8, (1e-3,), 32),
}
FRAMEWORK_ENTRY = "from palu_trainer.framework.plugin import {0}_main; {0}_main()"
CPU_TRAINING = [
    "+runtime=cpu",
    "model=tiny-llama",
    "trainer.args.gradient_accumulation_steps=1",
    "trainer.args.do_eval=false",
    "trainer.args.eval_on_start=false",
    "trainer.args.eval_strategy=no",
    "trainer.args.report_to=none",
    "trainer.args.logging_steps=5",
]


class Progress:
    """Stage lines with elapsed time, so a person watching knows where the run is."""

    def __init__(self, total_stages: int):
        self.start = time.monotonic()
        self.total = total_stages
        self.done = 0
        self.stage_times: dict[str, float] = {}
        self.lock = threading.Lock()  # stages finish on worker threads

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.0f}s] {message}", flush=True)

    def stage(self, name: str, seconds: float, note: str = "") -> None:
        with self.lock:
            self.done += 1
            self.stage_times[name] = round(seconds, 1)
            self.say(f"({self.done}/{self.total}) {name}: {seconds:.0f} s{note}")


def file_digest(*paths: Path) -> str:
    digest = hashlib.sha1()
    for path in sorted(paths):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def benchmark_texts(data_dir: Path) -> list[str]:
    """Every question and answer string in the benchmark, to train the tokenizer on."""
    texts = []
    for path in sorted(data_dir.glob("*.json")):
        for row in read_jsonl(path):
            for value in row.values():
                texts.extend([value] if isinstance(value, str) else value)
    return texts


def run_framework(entry: str, overrides: list[str], log_path: Path, env: dict) -> float:
    """Run open-unlearning's train.py or eval.py (`entry` = train | eval) in a subprocess; return seconds."""
    command = [sys.executable, "-c", FRAMEWORK_ENTRY.format(entry), *overrides]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with log_path.open("w") as log:
        log.write(" ".join(command) + "\n\n")
        log.flush()
        result = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=log_path.parent)
    if result.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(True)[-40:])
        raise RuntimeError(f"{entry} failed (exit {result.returncode}); log {log_path}:\n{tail}")
    return time.monotonic() - start


def model_paths(model_dir: Path) -> list[str]:
    return [
        f"model.{args}.pretrained_model_name_or_path={model_dir}" for args in ("model_args", "tokenizer_args")
    ]


class Demo:
    def __init__(
        self, benchmark: TofuBenchmark, size: Size, run_dir: Path, cache_dir: Path, progress: Progress
    ):
        self.benchmark, self.size, self.run_dir, self.cache_dir = benchmark, size, run_dir, cache_dir
        self.progress = progress
        # One thread per process: a model this small gains nothing from a second one, and two OpenMP
        # threads on a busy 2-core machine spin against each other (measured: 10x slower steps).
        threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.env = {
            **threads,
            **os.environ,
            "TOFU_DIR": str(benchmark.tofu_dir),
            # `datasets` caches a local directory's configs under its base name, not its path or
            # contents: another run's `data/` would be served. One cache per run, emptied at its start.
            "HF_DATASETS_CACHE": str(run_dir / "datasets-cache"),
        }

    def run_cached_stage(self, stage: str, kind: str, key_parts: list[str], produce) -> tuple[Path, float]:
        """Run `produce(out_dir) -> seconds` once per key; later calls with that key reuse its output.

        Returns the output directory and the seconds it took to make (when it was made).
        """
        self.progress.say(f"{stage} …")
        key = hashlib.sha1("\n".join(key_parts).encode()).hexdigest()[:16]
        out_dir = self.cache_dir / f"{kind}-{key}"
        done = out_dir / "demo_stage.json"
        if done.is_file():
            seconds = json.loads(done.read_text())["wall_time_s"]
            self.progress.stage(stage, 0, f" (cached in {out_dir}, made in {seconds:.0f} s)")
            return out_dir, seconds
        shutil.rmtree(out_dir, ignore_errors=True)
        seconds = produce(out_dir)
        done.write_text(json.dumps({"wall_time_s": seconds, "key": key_parts}))
        self.progress.stage(stage, seconds)
        return out_dir, seconds

    def finetune(self, name: str, model_dir: Path, train_split: str) -> tuple[Path, float]:
        overrides = [
            "experiment=finetune/tofu/tiny",
            "+runtime=cpu",
            f"train_split={train_split}",
            f"trainer.args.num_train_epochs={self.size.finetune_epochs}",
            f"trainer.args.learning_rate={self.size.finetune_learning_rate}",
            f"task_name={name}",
        ]
        split_file = self.benchmark.tofu_dir / f"{train_split}.json"
        key = [
            file_digest(split_file),
            file_digest(*(model_dir / f for f in ("config.json", "model.safetensors", "tokenizer.json"))),
            file_digest(CONFIG_DIR / "experiment" / "finetune" / "tofu" / "tiny.yaml"),
            *overrides,
        ]

        def produce(out_dir: Path) -> float:
            arguments = [*overrides, *model_paths(model_dir), f"paths.output_dir={out_dir}"]
            return run_framework("train", arguments, self.run_dir / "logs" / f"finetune_{name}.log", self.env)

        return self.run_cached_stage(f"finetune {name} on {train_split}", "finetune", key, produce)

    def evaluate(self, name: str, model_dir: Path, retain_logs, cache: bool) -> Path:
        """Stock TOFU evaluation; `retain_logs()` gives Retain's TOFU_EVAL.json (None for Retain itself)."""
        retain_logs = retain_logs()
        overrides = [
            "experiment=eval/tofu/tiny",
            "+runtime=cpu",
            f"forget_split={self.benchmark.forget_split}",
            f"holdout_split={self.benchmark.holdout_split}",
            f"max_new_tokens={self.benchmark.max_new_tokens}",
            f"retain_logs_path={retain_logs or 'null'}",
            f"task_name={name}_eval",
        ]

        def produce(out_dir: Path) -> float:
            arguments = [*overrides, *model_paths(model_dir), f"paths.output_dir={out_dir}"]
            return run_framework("eval", arguments, self.run_dir / "logs" / f"eval_{name}.log", self.env)

        stage = f"evaluate {name}"
        if cache:
            key = [
                file_digest(model_dir / "model.safetensors"),
                *self.benchmark_digest(),
                file_digest(CONFIG_DIR / "experiment" / "eval" / "tofu" / "tiny.yaml"),
                *overrides,
            ]
            out_dir, _ = self.run_cached_stage(stage, "eval", key, produce)
        else:
            out_dir = self.run_dir / "evals" / name
            self.progress.say(f"{stage} …")
            self.progress.stage(stage, produce(out_dir))
        return out_dir / "TOFU_EVAL.json"

    def benchmark_digest(self) -> list[str]:
        return [file_digest(*self.benchmark.tofu_dir.glob("*.json"))]

    def unlearn_and_evaluate(self, method: str, learning_rate: float, original_dir: Path, retain_logs):
        """Unlearn Original with `method`, then evaluate; return (TOFU_EVAL.json, unlearning seconds)."""
        unlearned_dir, seconds = self.unlearn(method, learning_rate, original_dir)
        return self.evaluate(unlearned_dir.name, unlearned_dir, retain_logs, cache=False), seconds

    def unlearn_overrides(self, method: str, learning_rate: float, original_dir: Path, out_dir: Path):
        """The framework's train.py command line that unlearns Original with `method` (METHODS)."""
        spans = [f"span_annotations={self.benchmark.span_annotations}"] if METHODS[method].uses_spans else []
        idk = [f"idk_path={self.benchmark.idk_answers}"] if METHODS[method].uses_idk_answers else []
        return [
            "--config-name=unlearn.yaml",
            *tofu_overrides(method),
            *spans,
            *idk,
            *CPU_TRAINING,
            f"forget_split={self.benchmark.forget_split}",
            f"retain_split={self.benchmark.retain_split}",
            f"holdout_split={self.benchmark.holdout_split}",
            *model_paths(original_dir),
            f"trainer.args.learning_rate={learning_rate}",
            f"trainer.args.num_train_epochs={self.size.unlearn_epochs}",
            f"trainer.args.per_device_train_batch_size={self.size.unlearn_batch_size}",
            f"task_name={out_dir.name}",
            f"paths.output_dir={out_dir}",
        ]

    def unlearn(self, method: str, learning_rate: float, original_dir: Path) -> tuple[Path, float]:
        name = f"{method}_lr{learning_rate:g}"
        out_dir = self.run_dir / "unlearn" / name
        overrides = self.unlearn_overrides(method, learning_rate, original_dir, out_dir)
        self.progress.say(f"unlearn {name} …")
        seconds = run_framework("train", overrides, self.run_dir / "logs" / f"unlearn_{name}.log", self.env)
        self.progress.stage(f"unlearn {name}", seconds)
        return out_dir, seconds


def method_notes(methods, benchmark: TofuBenchmark) -> list[str]:
    """Report notes on what the methods' table entries add to their stock configs."""
    notes = [
        f"{name}: also {' '.join(METHODS[name].trainer_overrides)}."
        for name in methods
        if METHODS[name].trainer_overrides
    ]
    if any(METHODS[name].uses_idk_answers for name in methods):
        notes.append(
            f'"I don\'t know" answers: {len(IDK_ANSWERS)} phrasings written for this project to '
            f"{benchmark.idk_answers} (the framework downloads its own from the hub, open-unlearning/idk)."
        )
    return notes


def run(
    data: str,
    size_name: str,
    run_dir: Path,
    cache_dir: Path,
    seed: int,
    tofu_dir: Path | None = None,
    spans_file: Path | None = None,
    jobs: int = 1,
    methods: tuple[str, ...] | None = None,
) -> dict[str, Path]:
    size = SIZES[size_name]
    methods = methods or side_by_side_methods(fast=size_name == "fast")
    grid_runs = len(methods) * len(size.learning_rates)
    progress = Progress(total_stages=6 + 2 * grid_runs)
    shutil.rmtree(run_dir / "datasets-cache", ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    progress.say(f"demo: data={data}, size={size_name}, output {run_dir}")

    start = time.monotonic()
    data_dir = run_dir / "data"
    if data == "synthetic":
        benchmark = synthetic_benchmark(data_dir, size.num_authors, size.max_new_tokens, seed)
    else:
        benchmark = make_tofu_subset(tofu_dir, spans_file, data_dir)
    progress.stage(f"data: {benchmark.description}", time.monotonic() - start)

    start = time.monotonic()
    model_dir = save_tiny_model(
        run_dir / "tiny-llama",
        benchmark_texts(data_dir),
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        num_layers=size.num_layers,
        seed=seed,
    )
    # The tokenizer stops merging when the text has no more pairs: |V| can be below size.vocab_size.
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    progress.stage(
        f"tokenizer + Llama ({size.num_layers} layers, hidden {size.hidden_size})", time.monotonic() - start
    )

    demo = Demo(benchmark, size, run_dir, cache_dir, progress)
    # Single-threaded framework processes, `jobs` at a time; every wait below is on a job submitted
    # earlier, which already holds a worker, so the pool cannot deadlock.
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        original = pool.submit(demo.finetune, "Original", model_dir, "full")
        retain = pool.submit(demo.finetune, "Retain", model_dir, benchmark.retain_split)
        (original_dir, original_seconds), (retain_dir, retain_seconds) = original.result(), retain.result()
        retain_eval = pool.submit(demo.evaluate, "Retain", retain_dir, lambda: None, cache=True)
        original_eval = pool.submit(demo.evaluate, "Original", original_dir, retain_eval.result, cache=True)
        grid_jobs = {
            (method, learning_rate): pool.submit(
                demo.unlearn_and_evaluate, method, learning_rate, original_dir, retain_eval.result
            )
            for method in methods
            for learning_rate in size.learning_rates
        }
        grids: dict[str, list[report.EvaluatedModel]] = {}
        for (method, learning_rate), job in grid_jobs.items():
            eval_json, seconds = job.result()
            run_params = {"lr": learning_rate, "epochs": size.unlearn_epochs}
            grids.setdefault(method, []).append(report.run_from_eval(eval_json, seconds, run_params))
        original_eval, retain_eval = original_eval.result(), retain_eval.result()

    finetune_params = {"lr": size.finetune_learning_rate, "epochs": size.finetune_epochs}
    references = {
        "Original": report.run_from_eval(original_eval, original_seconds, finetune_params),
        "Retain": report.run_from_eval(retain_eval, retain_seconds, finetune_params),
    }
    # Forget quality is a KS test against Retain's own truth ratios: for Retain itself, exactly 1.
    references["Retain"].metrics["forget_quality"] = 1.0
    notes = [
        f"Data: {benchmark.description}; forget split {benchmark.forget_split}, retain split "
        f"{benchmark.retain_split}, holdout {benchmark.holdout_split}.",
        f"Model: Llama from scratch, {size.num_layers} layers, hidden {size.hidden_size}, byte-level BPE "
        f"vocabulary {vocab_size} (trained for at most {size.vocab_size}); every method unlearns Original "
        f"for {size.unlearn_epochs} epochs, batch {size.unlearn_batch_size}, learning rates "
        f"{list(size.learning_rates)}, each method's config defaults (the same tuning budget for all: the "
        "learning-rate grid only).",
        "Retain's FQ is the KS test of its truth ratios against themselves, 1 by definition; its "
        "privleak uses the stock reference AUC of 0.5.",
    ]
    for method in methods:
        top_k = OmegaConf.select(trainer_config(METHODS[method].trainer), "method_args.top_k")
        if top_k is not None:
            notes.append(
                f"{method}: top_k={top_k} gives K={resolve_top_k(top_k, vocab_size)} of the "
                f"{vocab_size}-token vocabulary (0.15625 is the paper's K=5000 of Llama-2's 32000)."
            )
    notes += method_notes(methods, benchmark)
    if data == "synthetic":
        notes.append(
            "real_authors / world_facts are synthetic stand-ins (palu_trainer.benchmarks.synthetic_tofu)."
        )
    paths = report.write_report(
        run_dir,
        references,
        grids,
        title=f"PALU vs stock unlearning methods — {benchmark.description}",
        notes=notes,
        extra={
            "stage_times_s": progress.stage_times,
            "size": {**asdict(size), "methods": methods},
            "data": data,
        },
    )
    progress.say(f"done in {time.monotonic() - progress.start:.0f} s")
    for label, path in paths.items():
        print(f"{label}: {path}")
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m palu_trainer.experiments.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--data", choices=("synthetic", "tofu"), default="synthetic")
    parser.add_argument("--fast", action="store_true", help="the ≤ 2 minute variant (tests)")
    parser.add_argument("--tofu-dir", type=Path, help="TOFU JSON files with the hub README (for --data tofu)")
    parser.add_argument(
        "--spans", type=Path, help="forget05 span annotations, TPO-style or this project's (for --data tofu)"
    )
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHODS), help="unlearning methods to run (default: the table's)"
    )
    parser.add_argument("--run", help="results/<run>/ (default: data name, + '-fast')")
    parser.add_argument("--results", type=Path, default=PROJECT_ROOT / "results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="framework processes at a time, 1 thread each")
    args = parser.parse_args(argv)
    if args.data == "tofu":
        if not args.tofu_dir:
            parser.error("--data tofu needs --tofu-dir (make demo DATA=tofu TOFU_DIR=...)")
        args.spans = args.spans or args.tofu_dir.parent / "tofu_spans_gpt4o" / "forget05.jsonl"
    run_name = args.run or args.data + ("-fast" if args.fast else "")
    run(
        args.data,
        "fast" if args.fast else "full",
        args.results / run_name,
        args.results / ".cache",
        args.seed,
        args.tofu_dir,
        args.spans,
        args.jobs,
        tuple(args.methods) if args.methods else None,
    )


if __name__ == "__main__":
    main()
