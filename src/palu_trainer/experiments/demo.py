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

from palu_trainer.benchmarks.hf_dir import read_jsonl
from palu_trainer.benchmarks.synthetic_tofu import synthetic_benchmark
from palu_trainer.benchmarks.tofu_format import TofuBenchmark
from palu_trainer.benchmarks.tofu_subset import make_tofu_subset
from palu_trainer.experiments import report
from palu_trainer.experiments.methods import METHODS, side_by_side_methods, tofu_overrides
from palu_trainer.experiments.tiny import save_tiny_model
from palu_trainer.framework.checkout import CONFIG_DIR, PROJECT_ROOT


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
    tune_knobs: bool  # grid every method's own knob (methods.Knob) besides the learning rate


SIZES = {
    "full": Size(40, 128, 2, 4096, 25, 3e-3, 10, 8, (3e-4, 1e-3, 3e-3), 48, True),
    "fast": Size(16, 64, 2, 1024, 30, 5e-3, 5, 8, (1e-3,), 32, False),
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
        # Made under a private name and renamed when complete: `make ablation` and `make convergence` may
        # run at once on one cache, and neither may see (or delete) the other's half-made output.
        partial = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}-{threading.get_ident()}")
        shutil.rmtree(partial, ignore_errors=True)
        seconds = produce(partial)
        (partial / "demo_stage.json").write_text(json.dumps({"wall_time_s": seconds, "key": key_parts}))
        if out_dir.exists() and not done.is_file():  # left by an interrupted run
            shutil.rmtree(out_dir)
        try:
            partial.rename(out_dir)
        except OSError:  # another run finished the same stage first: use its output
            shutil.rmtree(partial)
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

    def finished_evaluation(self, name: str, like: Path) -> Path | None:
        """The TOFU_EVAL.json of an earlier `evaluate(name, ..., cache=False)` in this run folder, if it has
        every metric of `like` (a stopped run can leave a partial one); else None."""
        path = self.run_dir / "evals" / name / "TOFU_EVAL.json"
        if path.is_file() and set(json.loads(like.read_text())) <= set(json.loads(path.read_text())):
            return path
        return None

    def benchmark_digest(self) -> list[str]:
        return [file_digest(*self.benchmark.tofu_dir.glob("*.json"))]

    def unlearn_and_evaluate(
        self, method: str, learning_rate: float, original_dir: Path, retain_logs, extra=(), name=None
    ):
        """Unlearn Original with `method`, then evaluate; return (TOFU_EVAL.json, unlearning seconds)."""
        unlearned_dir, seconds = self.unlearn(method, learning_rate, original_dir, extra, name)
        return self.evaluate(unlearned_dir.name, unlearned_dir, retain_logs, cache=False), seconds

    def unlearn_overrides(
        self, method: str, learning_rate: float, original_dir: Path, out_dir: Path, extra=()
    ) -> list[str]:
        """The framework's train.py command line that unlearns Original with `method` (METHODS).

        `extra` overrides come last (a knob's value, an ablation point).
        """
        spans = [f"span_annotations={self.benchmark.span_annotations}"] if METHODS[method].uses_spans else []
        return [
            "--config-name=unlearn.yaml",
            *tofu_overrides(method),
            *spans,
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


@dataclass
class Miniature:
    """What every experiment on the miniature starts from: data, tiny model, Original and Retain.

    `original_eval` and `retain_eval` are futures of their TOFU_EVAL.json paths (evaluations run on the
    pool while unlearning starts); `retain_eval.result` is what `Demo.evaluate` takes as `retain_logs`.
    """

    benchmark: TofuBenchmark
    size: Size
    demo: Demo
    progress: Progress
    original_dir: Path
    original_seconds: float
    retain_seconds: float
    original_eval: Future
    retain_eval: Future
    data: str

    def references(self) -> dict[str, report.EvaluatedModel]:
        params = {"lr": self.size.finetune_learning_rate, "epochs": self.size.finetune_epochs}
        references = {
            "Original": report.run_from_eval(self.original_eval.result(), self.original_seconds, params),
            "Retain": report.run_from_eval(self.retain_eval.result(), self.retain_seconds, params),
        }
        # Forget quality is a KS test against Retain's own truth ratios: for Retain itself, exactly 1.
        references["Retain"].metrics["forget_quality"] = 1.0
        return references

    def notes(self) -> list[str]:
        """The report's notes on the data and the model."""
        benchmark, size = self.benchmark, self.size
        notes = [
            f"Data: {benchmark.description}; forget split {benchmark.forget_split}, retain split "
            f"{benchmark.retain_split}, holdout {benchmark.holdout_split}.",
            f"Model: Llama from scratch, {size.num_layers} layers, hidden {size.hidden_size}, byte-level BPE "
            f"vocabulary {size.vocab_size}; unlearning runs {size.unlearn_epochs} epochs from Original, "
            f"batch {size.unlearn_batch_size}.",
            "Retain's FQ is the KS test of its truth ratios against themselves, 1 by definition; its "
            "privleak uses the stock reference AUC of 0.5.",
        ]
        if self.data == "synthetic":
            notes.append(
                "real_authors / world_facts are synthetic stand-ins (palu_trainer.benchmarks.synthetic_tofu)."
            )
        return notes


def build_miniature(
    data: str,
    size_name: str,
    run_dir: Path,
    cache_dir: Path,
    seed: int,
    pool: ThreadPoolExecutor,
    progress: Progress,
    tofu_dir: Path | None = None,
    spans_file: Path | None = None,
) -> Miniature:
    """Data and tiny model in `run_dir`, Original and Retain finetuned (cached in `cache_dir`), evaluations
    submitted to `pool`. Returns once Original and Retain exist."""
    size = SIZES[size_name]
    shutil.rmtree(run_dir / "datasets-cache", ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    progress.say(f"data={data}, size={size_name}, output {run_dir}")

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
    progress.stage(
        f"tokenizer + Llama ({size.num_layers} layers, hidden {size.hidden_size})", time.monotonic() - start
    )

    demo = Demo(benchmark, size, run_dir, cache_dir, progress)
    # Single-threaded framework processes, `jobs` at a time; every wait on the pool is on a job submitted
    # earlier, which already holds a worker, so the pool cannot deadlock.
    original = pool.submit(demo.finetune, "Original", model_dir, "full")
    retain = pool.submit(demo.finetune, "Retain", model_dir, benchmark.retain_split)
    (original_dir, original_seconds), (retain_dir, retain_seconds) = original.result(), retain.result()
    retain_eval = pool.submit(demo.evaluate, "Retain", retain_dir, lambda: None, cache=True)
    original_eval = pool.submit(demo.evaluate, "Original", original_dir, retain_eval.result, cache=True)
    return Miniature(
        benchmark, size, demo, progress, original_dir, original_seconds, retain_seconds, original_eval,
        retain_eval, data,
    )  # fmt: skip


MINIATURE_STAGES = 6  # data, model, two finetunings, two evaluations


def knob_grid(method: str, tune_knobs: bool) -> list[tuple[dict, list[str]]]:
    """(report params, overrides) per value of the method's knob; one stock run without a knob grid."""
    knob = METHODS[method].knob
    if not (tune_knobs and knob):
        return [({}, [])]
    return [({knob.name: value}, [f"{knob.key}={value}"]) for value in knob.values]


def tuning_budget(methods, learning_rates, tune_knobs: bool) -> str:
    """The report's line on how many runs each method had and over what."""
    parts = []
    for method in methods:
        knob = METHODS[method].knob
        runs = len(learning_rates) * len(knob_grid(method, tune_knobs))
        grid = f" x {knob.name} {list(knob.values)} (`{knob.key}`)" if tune_knobs and knob else ""
        parts.append(f"{method} {runs} runs: lr {list(learning_rates)}{grid}")
    return "Tuning budget, the same for every method: " + "; ".join(parts) + "."


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
    grid = [
        (method, learning_rate, params, overrides)
        for method in methods
        for learning_rate in size.learning_rates
        for params, overrides in knob_grid(method, size.tune_knobs)
    ]
    progress = Progress(total_stages=MINIATURE_STAGES + 2 * len(grid))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        mini = build_miniature(
            data, size_name, run_dir, cache_dir, seed, pool, progress, tofu_dir, spans_file
        )
        grid_jobs = {
            (method, learning_rate, tuple(params.items())): pool.submit(
                mini.demo.unlearn_and_evaluate,
                method,
                learning_rate,
                mini.original_dir,
                mini.retain_eval.result,
                overrides,
                f"{method}_lr{learning_rate:g}" + "".join(f"_{k}{v:g}" for k, v in params.items()),
            )
            for method, learning_rate, params, overrides in grid
        }
        grids: dict[str, list[report.EvaluatedModel]] = {}
        for (method, learning_rate, params), job in grid_jobs.items():
            eval_json, seconds = job.result()
            run_params = {"lr": learning_rate, **dict(params), "epochs": size.unlearn_epochs}
            grids.setdefault(method, []).append(report.run_from_eval(eval_json, seconds, run_params))
        references = mini.references()

    paths = report.write_report(
        run_dir,
        references,
        grids,
        title=f"PALU vs stock unlearning methods — {mini.benchmark.description}",
        notes=[*mini.notes(), tuning_budget(methods, size.learning_rates, size.tune_knobs)],
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


def add_miniature_arguments(parser: argparse.ArgumentParser, render: bool = False) -> None:
    """The options every experiment on the miniature shares (data, size, output, parallelism); `render`:
    also --render (the analyses, whose runs are saved one evaluation at a time)."""
    parser.add_argument("--data", choices=("synthetic", "tofu"), default="synthetic")
    parser.add_argument("--fast", action="store_true", help="the small variant (tests)")
    parser.add_argument("--tofu-dir", type=Path, help="TOFU JSON files with the hub README (for --data tofu)")
    parser.add_argument(
        "--spans", type=Path, help="forget05 span annotations, TPO-style or this project's (for --data tofu)"
    )
    parser.add_argument("--run", help="results/<run>/ (default: the command's name, -tofu, -fast)")
    parser.add_argument("--results", type=Path, default=PROJECT_ROOT / "results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="framework processes at a time, 1 thread each")
    if render:
        parser.add_argument(
            "--render",
            action="store_true",
            help="no unlearning: write the charts and tables from the evaluations already in the run folder "
            "(of a run that was stopped); points without a complete evaluation are marked as not run",
        )


def parse_miniature_arguments(parser: argparse.ArgumentParser, argv, experiment: str = ""):
    """Parse; fill the spans default for --data tofu; `args.run_dir` is results/<--run>, by default
    results/<experiment>[-tofu][-fast] (the demo: results/<data>[-fast])."""
    args = parser.parse_args(argv)
    if args.data == "tofu":
        if not args.tofu_dir:
            parser.error("--data tofu needs --tofu-dir (DATA=tofu TOFU_DIR=...)")
        args.spans = args.spans or args.tofu_dir.parent / "tofu_spans_gpt4o" / "forget05.jsonl"
    args.size = "fast" if args.fast else "full"
    default_run = "-".join(
        filter(None, [experiment, "" if experiment and args.data == "synthetic" else args.data])
    )
    args.run_dir = args.results / (args.run or default_run + ("-fast" if args.fast else ""))
    return args


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m palu_trainer.experiments.demo", description=__doc__.splitlines()[0]
    )
    add_miniature_arguments(parser)
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHODS), help="unlearning methods to run (default: the table's)"
    )
    args = parse_miniature_arguments(parser, argv)
    run(
        args.data,
        args.size,
        args.run_dir,
        args.results / ".cache",
        args.seed,
        args.tofu_dir,
        args.spans,
        args.jobs,
        tuple(args.methods) if args.methods else None,
    )


if __name__ == "__main__":
    main()
