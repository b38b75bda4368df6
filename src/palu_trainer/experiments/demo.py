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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import OmegaConf

from palu_trainer.benchmarks.hf_dir import read_jsonl
from palu_trainer.benchmarks.muse_subset import SYNTHETIC_ARTICLES, make_muse_subset
from palu_trainer.benchmarks.synthetic_tofu import synthetic_benchmark
from palu_trainer.benchmarks.tofu_format import IDK_ANSWERS, TofuBenchmark
from palu_trainer.benchmarks.tofu_subset import make_tofu_subset
from palu_trainer.experiments import report
from palu_trainer.experiments.methods import (
    METHODS,
    muse_overrides,
    side_by_side_methods,
    tofu_overrides,
    tuning_grid,
)
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
    tune_knobs: bool  # the equal-budget grid: learning rates x every method's knob (methods.tuning_grid)


@dataclass(frozen=True)
class MuseSize(Size):
    """The MUSE miniature's sizes: `num_authors` counts article runs (see benchmarks.muse_subset)."""

    num_retain: int
    num_holdout: int
    max_length: int  # unlearning's forget/retain chunks (tokens), as long as a verbmem row (~1200)


SIZES = {
    "full": Size(40, 128, 2, 4096, 25, 3e-3, 10, 8, (3e-4, 1e-3, 3e-3), 48, True),
    "fast": Size(16, 64, 2, 1024, 30, 5e-3, 5, 8, (1e-3,), 32, False),
}
MUSE_SIZES = {
    "full": MuseSize(2, 128, 2, 4096, 60, 5e-3, 5, 1, (1e-3, 3e-3), 128, False, 2, 6, 1280),
    "fast": MuseSize(1, 128, 2, 2048, 60, 5e-3, 10, 1, (1e-3,), 128, False, 1, 4, 1280),
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
            self.mirror_variable: str(self.data_dir()),
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

    # Per benchmark: its local folder's mirror variable, configs and files (MuseDemo overrides these)
    mirror_variable = "TOFU_DIR"
    finetune_experiment = "finetune/tofu/tiny"
    eval_experiment = "eval/tofu/tiny"
    eval_file = "TOFU_EVAL.json"
    scorecard = report.TOFU

    def data_dir(self) -> Path:
        return self.benchmark.tofu_dir

    def split_files(self, train_split: str) -> list[Path]:
        return [self.benchmark.tofu_dir / f"{train_split}.json"]

    def benchmark_overrides(self) -> list[str]:
        return [
            f"forget_split={self.benchmark.forget_split}",
            f"holdout_split={self.benchmark.holdout_split}",
            f"max_new_tokens={self.benchmark.max_new_tokens}",
        ]

    def method_overrides(self, method: str) -> list[str]:
        return [
            *tofu_overrides(method),
            f"forget_split={self.benchmark.forget_split}",
            f"retain_split={self.benchmark.retain_split}",
            f"holdout_split={self.benchmark.holdout_split}",
        ]

    def finetune(self, name: str, model_dir: Path, train_split: str) -> tuple[Path, float]:
        overrides = [
            f"experiment={self.finetune_experiment}",
            "+runtime=cpu",
            f"train_split={train_split}",
            f"trainer.args.num_train_epochs={self.size.finetune_epochs}",
            f"trainer.args.learning_rate={self.size.finetune_learning_rate}",
            f"task_name={name}",
        ]
        key = [
            file_digest(*self.split_files(train_split)),
            file_digest(*(model_dir / f for f in ("config.json", "model.safetensors", "tokenizer.json"))),
            file_digest(CONFIG_DIR / "experiment" / f"{self.finetune_experiment}.yaml"),
            *overrides,
        ]

        def produce(out_dir: Path) -> float:
            arguments = [*overrides, *model_paths(model_dir), f"paths.output_dir={out_dir}"]
            return run_framework("train", arguments, self.run_dir / "logs" / f"finetune_{name}.log", self.env)

        return self.run_cached_stage(f"finetune {name} on {train_split}", "finetune", key, produce)

    def evaluate(self, name: str, model_dir: Path, retain_logs, cache: bool) -> Path:
        """Stock evaluation; `retain_logs()` gives Retain's eval file (None for Retain itself)."""
        retain_logs = retain_logs()
        overrides = [
            f"experiment={self.eval_experiment}",
            "+runtime=cpu",
            *self.benchmark_overrides(),
            *self.scorecard.metric_overrides(cuda=False),
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
                file_digest(CONFIG_DIR / "experiment" / f"{self.eval_experiment}.yaml"),
                *overrides,
            ]
            out_dir, _ = self.run_cached_stage(stage, "eval", key, produce)
        else:
            out_dir = self.run_dir / "evals" / name
            self.progress.say(f"{stage} …")
            self.progress.stage(stage, produce(out_dir))
        return out_dir / self.eval_file

    def benchmark_digest(self) -> list[str]:
        return [file_digest(*self.data_dir().glob("*.json"))]

    def unlearn_and_evaluate(
        self, method: str, learning_rate: float, original_dir: Path, retain_logs, extra=(), name=None
    ):
        """Unlearn Original with `method`, then evaluate; return (eval file, unlearning seconds)."""
        unlearned_dir, seconds = self.unlearn(method, learning_rate, original_dir, extra, name)
        return self.evaluate(unlearned_dir.name, unlearned_dir, retain_logs, cache=False), seconds

    def unlearn_overrides(
        self, method: str, learning_rate: float, original_dir: Path, out_dir: Path, extra=()
    ) -> list[str]:
        """The framework's train.py command line that unlearns Original with `method` (METHODS); `extra`
        overrides come last (a knob's value, an ablation point)."""
        spans = [f"span_annotations={self.benchmark.span_annotations}"] if METHODS[method].uses_spans else []
        idk = [f"idk_path={self.benchmark.idk_answers}"] if METHODS[method].uses_idk_answers else []
        return [
            "--config-name=unlearn.yaml",
            *self.method_overrides(method),
            *spans,
            *idk,
            *CPU_TRAINING,
            *model_paths(original_dir),
            f"trainer.args.learning_rate={learning_rate}",
            f"trainer.args.num_train_epochs={self.size.unlearn_epochs}",
            f"trainer.args.per_device_train_batch_size={self.size.unlearn_batch_size}",
            f"task_name={out_dir.name}",
            f"paths.output_dir={out_dir}",
            *extra,
        ]

    def unlearn(
        self, method: str, learning_rate: float, original_dir: Path, extra=(), name=None
    ) -> tuple[Path, float]:
        name = name or f"{method}_lr{learning_rate:g}"
        out_dir = self.run_dir / "unlearn" / name
        overrides = self.unlearn_overrides(method, learning_rate, original_dir, out_dir, extra)
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


class MuseDemo(Demo):
    """The MUSE miniature: the local MUSE-News subset as `MUSE_DIR`, raw text in `max_length` chunks."""

    mirror_variable = "MUSE_DIR"
    finetune_experiment = "finetune/muse/tiny"
    eval_experiment = "eval/muse/tiny"
    eval_file = "MUSE_EVAL.json"
    scorecard = report.MUSE

    def data_dir(self) -> Path:
        return self.benchmark.muse_dir

    def split_files(self, train_split: str) -> list[Path]:
        return [self.benchmark.muse_dir / "raw" / f"{train_split}.jsonl"]

    def benchmark_digest(self) -> list[str]:
        return [file_digest(*self.benchmark.muse_dir.glob("*/*.jsonl"))]

    def benchmark_overrides(self) -> list[str]:
        return [f"max_new_tokens={self.size.max_new_tokens}"]

    def method_overrides(self, method: str) -> list[str]:
        forget = "MUSE_forget_spans" if METHODS[method].uses_spans else "MUSE_forget"
        return [
            *muse_overrides(method),
            f"data.forget.{forget}.args.max_length={self.size.max_length}",
            f"data.retain.MUSE_retain.args.max_length={self.size.max_length}",
        ]


def grid_runs(methods, size: Size) -> list[tuple[str, float, dict, tuple[str, ...]]]:
    """(method, learning rate, report params, extra overrides) of every unlearning run of a comparison."""
    return [
        (method, rate, params, extra)
        for method in methods
        for rate, params, extra in tuning_grid(method, size.learning_rates, size.tune_knobs)
    ]


def run_name(method: str, params: dict) -> str:
    """NPO_lr0.001, or NPO_lr0.001_beta0.5 for a knob's value."""
    return method + "".join(f"_{key}{value:g}" for key, value in params.items())


def tuning_budget(methods, size: Size) -> str:
    """The report's line on how many runs each method had, and over what."""
    parts = []
    for method in methods:
        runs = tuning_grid(method, size.learning_rates, size.tune_knobs)
        rates = sorted({rate for rate, _, _ in runs})
        knob = METHODS[method].knob if size.tune_knobs else None
        grid = f" x {knob.name} {list(knob.values)} (`{knob.key}`)" if knob else ""
        parts.append(f"{method} {len(runs)} runs: lr {rates}{grid}")
    return "Tuning budget (then the selection rule above): " + "; ".join(parts) + "."


def start_run(bench: str, data: str, size_name: str, run_dir: Path, stages: int) -> Progress:
    """The run folder and the progress lines of a run with `stages` stages besides the miniature's."""
    progress = Progress(total_stages=MINIATURE_STAGES + stages)
    shutil.rmtree(run_dir / "datasets-cache", ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    progress.say(f"bench={bench}, data={data}, size={size_name}, output {run_dir}")
    return progress


MINIATURE_STAGES = 6  # data, tokenizer and model, two finetunings, two evaluations


def make_model(
    run_dir: Path, texts: list[str], size: Size, seed: int, progress: Progress
) -> tuple[Path, int]:
    """The tokenizer and tiny Llama; returns their folder and the vocabulary size they reached."""
    start = time.monotonic()
    model_dir = save_tiny_model(
        run_dir / "tiny-llama",
        texts,
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
    return model_dir, vocab_size


@dataclass
class Miniature:
    """What every experiment on a miniature starts from: Original and Retain, finetuned (or cached), and
    their evaluations running on the pool (`*_eval` are futures of eval files; `retain_eval.result` is what
    `Demo.evaluate` takes as `retain_logs`). `notes`: the report's lines on data and model."""

    demo: Demo
    vocab_size: int
    original_dir: Path
    original_seconds: float
    retain_seconds: float
    original_eval: Future
    retain_eval: Future
    notes: list[str]

    def references(self) -> dict[str, report.EvaluatedModel]:
        size, scorecard = self.demo.size, self.demo.scorecard
        params = {"lr": size.finetune_learning_rate, "epochs": size.finetune_epochs}
        references = {
            "Original": report.run_from_eval(
                self.original_eval.result(), self.original_seconds, params, scorecard
            ),
            "Retain": report.run_from_eval(self.retain_eval.result(), self.retain_seconds, params, scorecard),
        }
        if scorecard is report.TOFU:
            # Forget quality is a KS test against Retain's own truth ratios: for Retain itself, exactly 1.
            references["Retain"].metrics["forget_quality"] = 1.0
        return references

    def unlearn_and_evaluate(self, method: str, learning_rate: float, extra=(), name=None):
        """Unlearn Original (`Demo.unlearn_and_evaluate`), evaluated against Retain."""
        return self.demo.unlearn_and_evaluate(
            method, learning_rate, self.original_dir, self.retain_eval.result, extra, name
        )


def finetune_references(
    demo: Demo, model_dir: Path, retain_split: str, vocab_size: int, pool, notes: list[str]
) -> Miniature:
    """Finetune Original on `full` and Retain on `retain_split` (or take them from the cache) and submit
    their evaluations. Single-threaded framework processes run `jobs` at a time on `pool`; every wait is on
    a job submitted earlier, which already holds a worker, so the pool cannot deadlock."""
    original = pool.submit(demo.finetune, "Original", model_dir, "full")
    retain = pool.submit(demo.finetune, "Retain", model_dir, retain_split)
    (original_dir, original_seconds), (retain_dir, retain_seconds) = original.result(), retain.result()
    retain_eval = pool.submit(demo.evaluate, "Retain", retain_dir, lambda: None, cache=True)
    original_eval = pool.submit(demo.evaluate, "Original", original_dir, retain_eval.result, cache=True)
    return Miniature(
        demo, vocab_size, original_dir, original_seconds, retain_seconds, original_eval, retain_eval, notes
    )


def tofu_miniature(
    data: str,
    size: Size,
    run_dir: Path,
    cache_dir: Path,
    seed: int,
    progress: Progress,
    pool,
    tofu_dir: Path | None = None,
    spans_file: Path | None = None,
) -> Miniature:
    """The TOFU miniature: synthetic authors or a real-TOFU subset, its tokenizer and tiny Llama, Original
    and Retain."""
    start = time.monotonic()
    data_dir = run_dir / "data"
    if data == "synthetic":
        benchmark = synthetic_benchmark(data_dir, size.num_authors, size.max_new_tokens, seed)
    else:
        benchmark = make_tofu_subset(tofu_dir, spans_file, data_dir)
    progress.stage(f"data: {benchmark.description}", time.monotonic() - start)
    model_dir, vocab_size = make_model(run_dir, benchmark_texts(data_dir), size, seed, progress)
    notes = [
        f"Data: {benchmark.description}; forget split {benchmark.forget_split}, retain split "
        f"{benchmark.retain_split}, holdout {benchmark.holdout_split}.",
        f"Model: Llama from scratch, {size.num_layers} layers, hidden {size.hidden_size}, byte-level BPE "
        f"vocabulary {vocab_size} (trained for at most {size.vocab_size}); unlearning starts from Original "
        f"and runs {size.unlearn_epochs} epochs, batch {size.unlearn_batch_size}.",
        "Retain's FQ is the KS test of its truth ratios against themselves, 1 by definition; its "
        "privleak uses the stock reference AUC of 0.5.",
    ]
    if data == "synthetic":
        notes.append(
            "real_authors / world_facts are synthetic stand-ins (palu_trainer.benchmarks.synthetic_tofu)."
        )
    demo = Demo(benchmark, size, run_dir, cache_dir, progress)
    return finetune_references(demo, model_dir, benchmark.retain_split, vocab_size, pool, notes)


def unlearn_grid(mini: Miniature, methods, pool) -> dict[str, list[report.EvaluatedModel]]:
    """Unlearn Original with every method at every point of its tuning grid, evaluate each."""
    size = mini.demo.size
    jobs = {
        (method, tuple(params.items())): pool.submit(
            mini.unlearn_and_evaluate, method, rate, extra, run_name(method, params)
        )
        for method, rate, params, extra in grid_runs(methods, size)
    }
    grids: dict[str, list[report.EvaluatedModel]] = {}
    for (method, params), job in jobs.items():
        eval_json, seconds = job.result()
        run_params = {**dict(params), "epochs": size.unlearn_epochs}
        grids.setdefault(method, []).append(
            report.run_from_eval(eval_json, seconds, run_params, mini.demo.scorecard)
        )
    return grids


def top_k_notes(methods, vocab_size: int) -> list[str]:
    """What each method's `top_k` resolves to on this vocabulary (a share of |V| means the same on any)."""
    notes = []
    for method in methods:
        top_k = OmegaConf.select(trainer_config(METHODS[method].trainer), "method_args.top_k")
        if top_k is not None:
            notes.append(
                f"{method}: top_k={top_k} gives K={resolve_top_k(top_k, vocab_size)} of the "
                f"{vocab_size}-token vocabulary (0.15625 is the paper's K=5000 of Llama-2's 32000)."
            )
    return notes


def finish(
    run_dir: Path,
    progress: Progress,
    references,
    grids,
    size: Size,
    methods,
    data: str,
    extra: dict | None = None,
    **report_args,
):
    """Write the report (`report_args`: write_report's title, notes, scorecard; `extra`: more JSON)."""
    paths = report.write_report(
        run_dir,
        references,
        grids,
        extra={
            "stage_times_s": progress.stage_times,
            "size": {**asdict(size), "methods": methods},
            "data": data,
            **(extra or {}),
        },
        **report_args,
    )
    progress.say(f"done in {time.monotonic() - progress.start:.0f} s")
    for label, path in paths.items():
        print(f"{label}: {path}")
    return paths


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
    progress = start_run("tofu", data, size_name, run_dir, 2 * len(grid_runs(methods, size)))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        mini = tofu_miniature(data, size, run_dir, cache_dir, seed, progress, pool, tofu_dir, spans_file)
        grids = unlearn_grid(mini, methods, pool)
        references = mini.references()
    notes = [
        *mini.notes,
        tuning_budget(methods, size),
        *top_k_notes(methods, mini.vocab_size),
        *method_notes(methods, mini.demo.benchmark),
    ]
    return finish(
        run_dir,
        progress,
        references,
        grids,
        size,
        methods,
        data,
        title=f"PALU vs stock unlearning methods — {mini.demo.benchmark.description}",
        notes=notes,
    )


def run_muse(
    size_name: str,
    run_dir: Path,
    cache_dir: Path,
    seed: int,
    muse_dir: Path,
    jobs: int = 1,
    methods: tuple[str, ...] | None = None,
) -> dict[str, Path]:
    size = MUSE_SIZES[size_name]
    methods = methods or side_by_side_methods(fast=size_name == "fast", bench="muse")
    progress = start_run("muse", "news", size_name, run_dir, 2 * len(grid_runs(methods, size)))
    start = time.monotonic()
    benchmark = make_muse_subset(
        muse_dir,
        run_dir / "data",
        size.num_authors,
        size.num_retain,
        size.num_holdout,
        run_dir / "spans.jsonl",
    )
    progress.stage(f"data: {benchmark.description}", time.monotonic() - start)
    model_dir, vocab_size = make_model(run_dir, benchmark.texts(), size, seed, progress)
    demo = MuseDemo(benchmark, size, run_dir, cache_dir, progress)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        mini = finetune_references(demo, model_dir, "retain1", vocab_size, pool, [])
        grids = unlearn_grid(mini, methods, pool)
        references = mini.references()
    agreement = benchmark.annotator_agreement
    notes = [
        f"Data: {benchmark.description}. Rows: "
        + ", ".join(f"{name} {count}" for name, count in benchmark.rows.items())
        + ". KnowMem pairs are also rows of their side's corpus (a model trained from scratch has never "
        "seen a question otherwise; palu_trainer.benchmarks.muse_subset).",
        f"Model: Llama from scratch, {size.num_layers} layers, hidden {size.hidden_size}, byte-level BPE "
        f"vocabulary {vocab_size} (trained for at most {size.vocab_size}), finetuned on each corpus row "
        "as one sequence (the framework's "
        f"CompletionDataset); every method unlearns Original (forget and retain in the stock "
        f"PretrainingDataset's {size.max_length}-token chunks) for "
        f"{size.unlearn_epochs} epochs, batch {size.unlearn_batch_size}, learning rates "
        f"{list(size.learning_rates)}, stock defaults.",
        tuning_budget(methods, size),
        "PALU's spans: the annotator's raw-text mode on the subset's forget rows (background: "
        f"sust/forget_2); against the gold spans of {SYNTHETIC_ARTICLES} held-out synthetic news articles "
        f"(palu_trainer.benchmarks.synthetic_news) its word precision / recall / F1 are "
        f"{agreement.precision:.3f} / {agreement.recall:.3f} / {agreement.f1:.3f}.",
        "PrivLeak is relative to Retain's min-k% AUC; Retain's own uses the stock reference AUC of 0.5.",
    ]
    return finish(
        run_dir,
        progress,
        references,
        grids,
        size,
        methods,
        "muse-news",
        extra={
            "annotator_synthetic_news": {
                "precision": agreement.precision,
                "recall": agreement.recall,
                "f1": agreement.f1,
            }
        },
        title=f"PALU vs stock unlearning methods on MUSE — {benchmark.description}",
        notes=notes,
        scorecard=report.MUSE,
    )


def add_tofu_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every experiment on the TOFU miniature: data, size, output, parallelism."""
    parser.add_argument("--data", choices=("synthetic", "tofu"), default="synthetic", help="for --bench tofu")
    parser.add_argument("--fast", action="store_true", help="the small variant (tests)")
    parser.add_argument("--tofu-dir", type=Path, help="TOFU JSON files with the hub README (for --data tofu)")
    parser.add_argument(
        "--spans", type=Path, help="forget05 span annotations, TPO-style or this project's (for --data tofu)"
    )
    parser.add_argument("--run", help="results/<run>/ (default: the experiment, the data name, '-fast')")
    parser.add_argument("--results", type=Path, default=PROJECT_ROOT / "results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="framework processes at a time, 1 thread each")


def parse_tofu_arguments(parser: argparse.ArgumentParser, argv, experiment: str):
    """Parse; the spans default for --data tofu; `args.run_dir`: results/<--run>, by default
    results/<experiment>[-tofu][-fast] (the demo: results/<data>[-fast])."""
    args = parser.parse_args(argv)
    if args.data == "tofu":
        if not args.tofu_dir:
            parser.error("--data tofu needs --tofu-dir (DATA=tofu TOFU_DIR=...)")
        args.spans = args.spans or args.tofu_dir.parent / "tofu_spans_gpt4o" / "forget05.jsonl"
    args.size = "fast" if args.fast else "full"
    name = "-".join(
        part for part in (experiment, "" if experiment and args.data == "synthetic" else args.data) if part
    )
    args.run_dir = args.results / (args.run or name + ("-fast" if args.fast else ""))
    return args


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m palu_trainer.experiments.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--bench", choices=("tofu", "muse"), default="tofu")
    add_tofu_arguments(parser)
    parser.add_argument(
        "--muse-dir", type=Path, help="MUSE-News in the hub's layout (for --bench muse; default: ../shared)"
    )
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHODS), help="unlearning methods to run (default: the table's)"
    )
    args = parse_tofu_arguments(parser, argv, "")
    methods = tuple(args.methods) if args.methods else None
    if args.bench == "muse":
        muse_dir = args.muse_dir or PROJECT_ROOT.parent / "shared" / "data" / "muse_news"
        run_dir = args.results / (args.run or "muse" + ("-fast" if args.fast else ""))
        run_muse(args.size, run_dir, args.results / ".cache", args.seed, muse_dir, args.jobs, methods)
        return
    run(
        args.data,
        args.size,
        args.run_dir,
        args.results / ".cache",
        args.seed,
        args.tofu_dir,
        args.spans,
        args.jobs,
        methods,
    )


if __name__ == "__main__":
    main()
