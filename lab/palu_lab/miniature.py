"""The offline miniature that the CPU experiments (demo, ablation, convergence) start from, and their common
command line and run names.

A miniature: local benchmark data (synthetic TOFU, a real-TOFU subset, or a MUSE-News subset) → tokenizer
and tiny Llama from scratch → Original finetuned on `full` and Retain on the retain split (cached by a hash
of data, model and hyperparameters) → both evaluated with the stock evaluator. Experiments then unlearn
Original (`Stages.unlearn`). Every training and evaluation is a subprocess running the framework's own
train.py / eval.py through this plugin's entry points.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from palu_lab import logged_runs, smollm2
from palu_lab.benchmarks.dataset_folders import TofuBenchmark, read_jsonl
from palu_lab.benchmarks.muse_subset import make_muse_subset
from palu_lab.benchmarks.synthetic_tofu import synthetic_benchmark
from palu_lab.benchmarks.tofu_subset import TofuLayout, make_tofu_subset
from palu_lab.tiny import save_tiny_model
from palu_trainer.experiments import report
from palu_trainer.experiments.benchmark_facts import MUSE, TOFU
from palu_trainer.experiments.methods import METHODS
from palu_trainer.framework import launch
from palu_trainer.framework.checkout import CONFIG_DIR, PROJECT_ROOT


@dataclass(frozen=True, kw_only=True)
class Size:
    """How big a miniature's model and runs are; `TofuSize` and `MuseSize` add how much data."""

    hidden_size: int
    num_layers: int
    max_vocab_size: int  # the tokenizer's target; it stops earlier when the text has no more pairs to merge
    finetune_epochs: int
    finetune_learning_rate: float
    unlearn_epochs: int
    unlearn_batch_size: int
    unlearn_learning_rates: tuple[float, ...]
    eval_max_new_tokens: int
    tune_knobs: bool  # the equal-budget grid: learning rates x every method's knob (methods.tuning_grid)
    model_config: str = "tiny-llama"  # configs/model/<name>.yaml
    bf16: bool = False  # training under bf16 autocast, evaluation in bf16 (CPUs with avx512_bf16)
    finetune_batch_size: int | None = None  # None: the finetune experiment's
    eval_batch_size: int | None = None  # None: the evaluation experiment's
    training_overrides: tuple[str, ...] = ()  # more Hydra overrides of a real model's training runs


@dataclass(frozen=True, kw_only=True)
class TofuSize(Size):
    synthetic_authors: int  # trained authors of the synthetic data (`--data tofu` has its own subset)


@dataclass(frozen=True, kw_only=True)
class RealTofuSize(Size):
    """A real pretrained model (`model_config`, `hidden_size` etc. are its own) on a real-TOFU subset
    (`layout`), unlearned on `seeds` (the first tunes), with the costs the budget plan multiplies
    (measured on the 2-core machine, two framework processes at a time)."""

    layout: TofuLayout
    unlearn_batch_size: int = 8
    seeds: tuple[int, ...]
    step_seconds: float  # one training step, batch 8 x ~96 tokens, beside another job
    eval_seconds: float  # one stock evaluation of the layout's rows, beside another job
    process_seconds: float  # a framework process's start: imports, model load, data, reference cache


@dataclass(frozen=True, kw_only=True)
class MuseSize(Size):
    article_runs: int  # runs of consecutive forget articles kept (benchmarks.muse_subset's `num_windows`)
    retain_excerpts: int
    holdout_excerpts: int
    max_length: int  # unlearning's forget/retain chunks (tokens), as long as a verbmem row (~1200)


# `fast`: the small variant that `make test` runs
TOFU_SIZES = {
    "full": TofuSize(
        synthetic_authors=40,
        hidden_size=128,
        num_layers=2,
        max_vocab_size=4096,
        finetune_epochs=25,
        finetune_learning_rate=3e-3,
        unlearn_epochs=10,
        unlearn_batch_size=8,
        unlearn_learning_rates=(3e-4, 1e-3, 3e-3),
        eval_max_new_tokens=48,
        tune_knobs=True,
    ),
    "fast": TofuSize(
        synthetic_authors=16,
        hidden_size=64,
        num_layers=2,
        max_vocab_size=1024,
        finetune_epochs=30,
        finetune_learning_rate=5e-3,
        unlearn_epochs=5,
        unlearn_batch_size=8,
        unlearn_learning_rates=(1e-3,),
        eval_max_new_tokens=32,
        tune_knobs=False,
    ),
}
# SmolLM2-135M-Instruct (dequantised from 4 bits; experiments/smollm2.py) on real TOFU, `--model smollm2`
# (the real-model experiment, experiments/real_model.py). Budget of `smollm2` on the 2-core machine, two
# framework processes at a time (`--jobs 2`), from measured costs beside another job: a bf16-autocast
# training step of 8 x 96 tokens ~8 s; one evaluation of this layout in bf16 ~294 s (forget truth ratios
# 90 s, forget ROUGE 14 s, retain / real authors / world facts 58 s, the MIA attacks, ES and EM 130 s);
# a framework process's start ~15 s (more with a reference cache to build: 45 s counted).
# real_model.budget computes the same; `demo --model smollm2 --plan` prints it:
#   Original: 80 rows (2 forget + 2 retain authors) / batch 8 x 10 epochs = 100 steps x 8 s + 45 s start
#     = 14 min, Retain (40 rows, 50 steps) beside it;                              wall 14 min
#   2 reference evaluations, 2 x 300 s / 2;                                        wall 5 min
#   26 unlearning runs, each 40 forget rows / batch 8 x 2 epochs = 10 steps of a forget and a retain batch
#     and (NPO, SimNPO's none, TPO, PALU without its cache) a reference forward: 2.5 steps' work, 20 s
#     + 45 s start = 245 s, then one evaluation (300 s): 545 s;
#     tuning: 5 methods x 2 learning rates on seed 0 = 10 runs;                    wall 10 x 545 / 2 = 45 min
#     5 selected settings x seeds 1, 2 + PALU on GPT-4o spans and PALU with the reference model on
#     seeds 0, 1, 2 = 16 runs;                                                     wall 16 x 545 / 2 = 73 min
#   total 137 min of the 150. Measured (557847c, docs/real-model.md): 101 min; unlearning runs took
#   114-166 s and evaluations 244-268 s, the budget's 245 s and 300 s are margins.
SMOLLM2 = RealTofuSize(
    model_config="SmolLM2-135M-Instruct",
    hidden_size=576,
    num_layers=30,
    max_vocab_size=smollm2.VOCAB_SIZE,
    layout=TofuLayout(
        forget_authors=range(190, 192),  # 40 rows: FQ's KS test moves in steps of 1/40 (real_model.fq_ladder)
        retain_authors=range(0, 2),
        holdout_authors=range(170, 171),
        eval_rows=10,
        max_new_tokens=32,
    ),
    bf16=True,
    finetune_epochs=10,
    finetune_learning_rate=1e-4,
    finetune_batch_size=8,
    unlearn_epochs=2,
    unlearn_learning_rates=(3e-5, 1e-4),
    eval_max_new_tokens=32,
    eval_batch_size=16,
    tune_knobs=False,  # the stated subset of the knob grid: every method's stock knob, 2 learning rates
    seeds=(0, 1, 2),
    step_seconds=8.0,
    eval_seconds=300.0,
    process_seconds=45.0,
)
TOFU_SIZES["smollm2"] = SMOLLM2
REAL_MODELS = {"smollm2": SMOLLM2}
# The smoke run (`--model smollm2 --fast`): 2 forget rows, 1 step, 2 eval rows, seeds 0 and 1.
TOFU_SIZES["smollm2-fast"] = replace(
    SMOLLM2,
    layout=TofuLayout(
        forget_authors=range(190, 191),
        retain_authors=range(0, 1),
        holdout_authors=range(170, 171),
        rows_per_author=2,
        eval_rows=2,
        max_new_tokens=8,
    ),
    finetune_epochs=1,
    unlearn_epochs=1,
    unlearn_learning_rates=(5e-5,),
    eval_max_new_tokens=8,
    seeds=(0, 1),
    eval_seconds=30.0,
    process_seconds=15.0,
    # +runtime=cpu's warm-up (10%) makes a 1-step run's only step one at learning rate 0
    training_overrides=("trainer.args.warmup_ratio=0",),
)
MUSE_FULL = MuseSize(
    article_runs=2,
    retain_excerpts=2,
    holdout_excerpts=6,
    hidden_size=128,
    num_layers=2,
    max_vocab_size=4096,
    finetune_epochs=60,
    finetune_learning_rate=5e-3,
    unlearn_epochs=5,
    unlearn_batch_size=1,
    unlearn_learning_rates=(1e-3, 3e-3),
    eval_max_new_tokens=128,
    tune_knobs=False,
    max_length=1280,
)
MUSE_SIZES = {
    "full": MUSE_FULL,
    "fast": replace(
        MUSE_FULL,
        article_runs=1,
        retain_excerpts=1,
        holdout_excerpts=4,
        max_vocab_size=2048,
        unlearn_epochs=10,
        unlearn_learning_rates=(1e-3,),
    ),
}
CPU_TRAINING = [
    "+runtime=cpu",
    "trainer.args.gradient_accumulation_steps=1",
    "trainer.args.do_eval=false",
    "trainer.args.eval_on_start=false",
    "trainer.args.eval_strategy=no",
    "trainer.args.report_to=none",
    "trainer.args.logging_steps=5",
]
MINIATURE_STAGES = 6  # data, tokenizer and model, two finetunings, two evaluations


class Progress:
    """Stage lines with elapsed time, so a person watching knows where the run is."""

    def __init__(self, total_stages: int):
        self.start = time.monotonic()
        self.total = total_stages
        self.done = 0
        self.stage_times: dict[str, float] = {}
        # seconds each stage took when it was made, this run or an earlier one (cached): a run that spans
        # restarts states its machine time from these, not from its last invocation's wall time
        self.made_times: dict[str, float] = {}
        self.lock = threading.Lock()  # stages finish on worker threads

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.0f}s] {message}", flush=True)

    def finish(self, paths: dict) -> dict:
        """Say the run is done, with its wall time, and print what it wrote; returns `paths`."""
        self.say(f"done in {time.monotonic() - self.start:.0f} s")
        for label, path in paths.items():
            print(f"{label}: {path}")
        return paths

    def stage(self, name: str, seconds: float, note: str = "", made_in: float | None = None) -> None:
        """`made_in`: a cached stage's seconds when it was made (default: `seconds`)."""
        with self.lock:
            self.done += 1
            self.stage_times[name] = round(seconds, 1)
            self.made_times[name] = round(seconds if made_in is None else made_in, 1)
            self.say(f"({self.done}/{self.total}) {name}: {seconds:.0f} s{note}")


def file_digest(*paths: Path) -> str:
    digest = hashlib.sha1()
    for path in sorted(paths):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def config_digest(config_dir: Path = CONFIG_DIR) -> str:
    """What the plugin's configs set, not how their files are written: each YAML's content at the place its
    `@package` header puts it (else its group's), without comments or the `hydra:` section (callbacks, which
    train nothing). The unlearning stages' key holds it: hashing the files' bytes, the Hydra callback that
    369b410 added to the experiment YAMLs made every archived run of the converged experiment run again."""
    content = {}
    for path in sorted(config_dir.rglob("*.yaml")):
        relative = path.relative_to(config_dir)
        text = path.read_text()
        header = re.search(r"^#\s*@package\s+(\S+)", text, re.MULTILINE)
        package = header.group(1) if header else ".".join(relative.parent.parts)
        node = yaml.safe_load(text) or {}
        if package == "_global_":
            node.pop("hydra", None)
        else:
            for part in reversed(package.split(".")):
                node = {part: node}
        content[str(relative)] = node
    return hashlib.sha1(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()


def benchmark_texts(data_dir: Path) -> list[str]:
    """Every question and answer string in the benchmark, to train the tokenizer on."""
    texts = []
    for path in sorted(data_dir.glob("*.json")):
        for row in read_jsonl(path):
            for value in row.values():
                texts.extend([value] if isinstance(value, str) else value)
    return texts


def run_framework(entry: str, overrides: list[str], log_path: Path, env: dict) -> float:
    """Run `palu-train` or `palu-eval` (`entry` = train | eval) in a subprocess; return seconds."""
    code, seconds = logged_runs.run_logged(
        [*launch.command(f"palu-{entry}"), *overrides], log_path, env, log_path.parent
    )
    if code != 0:
        raise RuntimeError(
            f"{entry} failed (exit {code}); log {log_path}:\n{logged_runs.log_tail(log_path, 40)}"
        )
    return seconds


RESUME_STATE = ("optimizer.pt", "scheduler.pt", "rng_state.pth")


RESUMABLE_EPOCHS = (
    "++trainer.args.save_strategy=epoch",
    "++trainer.args.save_only_model=false",
    "++trainer.args.save_total_limit=1",
)


def resumable_checkpoint(out_dir: Path) -> Path | None:
    """The newest checkpoint of an unfinished run that holds what resuming needs."""
    checkpoints = sorted(
        (path for path in out_dir.glob("checkpoint-*") if path.name.split("-")[-1].isdigit()),
        key=lambda path: int(path.name.split("-")[-1]),
    )
    newest = checkpoints[-1] if checkpoints else None
    whole = newest is not None and (newest / "trainer_state.json").is_file()
    return newest if whole and all((newest / name).is_file() for name in RESUME_STATE[:2]) else None


def prune_optimizer_state(out_dir: Path, keep_newest: bool) -> None:
    checkpoints = sorted(
        (path for path in out_dir.glob("checkpoint-*") if path.name.split("-")[-1].isdigit()),
        key=lambda path: int(path.name.split("-")[-1]),
    )
    complete = [path for path in checkpoints if (path / "trainer_state.json").is_file()]
    for checkpoint in complete[:-1] if keep_newest else complete:
        for name in RESUME_STATE:
            (checkpoint / name).unlink(missing_ok=True)


class pruning_optimizer_state:
    """While a run trains, its older checkpoints lose their optimizer state (1 GB each for SmolLM2): only the
    newest is needed to resume; when it ends, all do."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.stop = out_dir, threading.Event()

    def __enter__(self):
        def prune():
            while not self.stop.wait(30):
                prune_optimizer_state(self.out_dir, keep_newest=True)

        self.thread = threading.Thread(target=prune, daemon=True)
        self.thread.start()

    def __exit__(self, kind, value, traceback):
        self.stop.set()
        self.thread.join()
        if kind is None:
            prune_optimizer_state(self.out_dir, keep_newest=False)
        return False


def model_paths(model_dir: Path) -> list[str]:
    return [
        f"model.{args}.pretrained_model_name_or_path={model_dir}" for args in ("model_args", "tokenizer_args")
    ]


def epochs_of(checkpoint: Path) -> float:
    """The epoch a Trainer checkpoint folder was saved at."""
    return json.loads((checkpoint / "trainer_state.json").read_text())["epoch"]


def whole_epoch_checkpoints(out_dir: Path) -> dict[int, Path]:
    """The checkpoints of `out_dir` saved at the end of an epoch, by epoch. A checkpoint saved mid-epoch (on
    SIGTERM, to resume) stands for no epoch: rounded, it could take the place of the epoch's own."""
    by_epoch = {}
    for path in out_dir.glob("checkpoint-*"):
        epoch = epochs_of(path)
        if abs(epoch - round(epoch)) < 1e-6:
            by_epoch[round(epoch)] = path
    return by_epoch


def unlearning_run_name(method: str, params: dict) -> str:
    """NPO_lr0.001, or NPO_lr0.001_beta0.5 for a knob's value (a text value as itself: a variant's name)."""
    return method + "".join(
        f"_{key}{value:g}" if isinstance(value, int | float) else f"_{value}" for key, value in params.items()
    )


class NotCached(RuntimeError):
    """A stage that a render-only run (`Stages.render_only`) would have to make."""


class Stages:
    """The framework's runs on the TOFU miniature: finetune and evaluate (cached), unlearn (`MuseStages`:
    on the MUSE one)."""

    facts = TOFU

    def __init__(
        self, benchmark: TofuBenchmark, size: Size, run_dir: Path, cache_dir: Path, progress: Progress
    ):
        self.benchmark, self.size, self.run_dir, self.cache_dir = benchmark, size, run_dir, cache_dir
        self.progress = progress
        self.render_only = False  # make nothing: read cached stages, raise NotCached for the others
        # One thread per process: a model this small gains nothing from a second one, and two OpenMP
        # threads on a busy 2-core machine spin against each other (measured: 10x slower steps).
        threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.env = {
            **threads,
            **os.environ,
            self.facts.mirror_variable(self.subset): str(self.data_dir()),
            # `datasets` caches a local directory's configs under its base name, not its path or
            # contents: another run's `data/` would be served. One cache per run, emptied at its start.
            "HF_DATASETS_CACHE": str(run_dir / "datasets-cache"),
        }

    def run_cached_stage(
        self, stage: str, kind: str, key_parts: list[str], produce, resumable: bool = False
    ) -> tuple[Path, float]:
        """Run `produce(out_dir) -> seconds` once per key; later calls with that key reuse its output.
        A `resumable` stage's unfinished folder is kept for `produce` to continue.

        Returns the output directory and the seconds it took to make (when it was made).
        """
        self.progress.say(f"{stage} …")
        key = hashlib.sha1("\n".join(key_parts).encode()).hexdigest()[:16]
        out_dir = self.cache_dir / f"{kind}-{key}"
        done = out_dir / "demo_stage.json"
        if done.is_file():
            seconds = json.loads(done.read_text())["wall_time_s"]
            self.progress.stage(stage, 0, f" (cached in {out_dir}, made in {seconds:.0f} s)", seconds)
            return out_dir, seconds
        if self.render_only:
            if kind == "finetune":  # weights are never archived; their folder's name keys the stages that are
                self.progress.stage(stage, 0, f" (render only: not made, {out_dir.name} keys what reads it)")
                return out_dir, 0.0
            raise NotCached(f"{stage} is neither cached nor archived ({out_dir.name})")
        if not resumable:
            shutil.rmtree(out_dir, ignore_errors=True)
        seconds = produce(out_dir)
        done.write_text(json.dumps({"wall_time_s": seconds, "key": key_parts}))
        self.progress.stage(stage, seconds)
        return out_dir, seconds

    @property
    def subset(self) -> str:
        """The TOFU subset the local data stands in for (`benchmark_facts.TOFU.splits`)."""
        return self.benchmark.forget_split.removeprefix("forget")

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
            *self.facts.method_overrides(method),
            f"forget_split={self.benchmark.forget_split}",
            f"retain_split={self.benchmark.retain_split}",
            f"holdout_split={self.benchmark.holdout_split}",
        ]

    def model_overrides(self, training: bool) -> list[str]:
        """The model config and precision of the size (a real model's: `model=<config>`, bf16)."""
        overrides = [f"model={self.size.model_config}"]
        if self.size.bf16:
            overrides.append(
                "trainer.args.bf16=true" if training else "model.model_args.torch_dtype=bfloat16"
            )
        return overrides + list(self.size.training_overrides if training else ())

    def finetune(self, name: str, model_dir: Path, train_split: str) -> tuple[Path, float]:
        experiment = f"finetune/{self.facts.name.lower()}/tiny"  # the plugin's, for `model=tiny-llama`
        batch = self.size.finetune_batch_size
        overrides = [
            f"experiment={experiment}",
            "+runtime=cpu",
            *(self.model_overrides(training=True) if self.size.model_config != "tiny-llama" else []),
            f"train_split={train_split}",
            f"trainer.args.num_train_epochs={self.size.finetune_epochs}",
            f"trainer.args.learning_rate={self.size.finetune_learning_rate}",
            *([f"trainer.args.per_device_train_batch_size={batch}"] if batch else []),
            f"task_name={name}",
        ]
        key = [
            file_digest(*self.split_files(train_split)),
            file_digest(*(model_dir / f for f in ("config.json", "model.safetensors", "tokenizer.json"))),
            file_digest(CONFIG_DIR / "experiment" / f"{experiment}.yaml"),
            *overrides,
        ]

        def produce(out_dir: Path) -> float:
            # a checkpoint per epoch with its optimizer state, the newest only, outside the key: a real
            # model's finetune takes hours on the CPU, and one stopped with its session continues
            arguments = [
                *overrides,
                *model_paths(model_dir),
                f"paths.output_dir={out_dir}",
                *RESUMABLE_EPOCHS,
            ]
            if resumable_checkpoint(out_dir):
                arguments.append("+trainer.args.resume_from_checkpoint=true")
                self.progress.say(f"finetune {name}: resuming from {resumable_checkpoint(out_dir)}")
            else:
                shutil.rmtree(out_dir, ignore_errors=True)
            seconds = run_framework(
                "train", arguments, self.run_dir / "logs" / f"finetune_{name}.log", self.env
            )
            for checkpoint in out_dir.glob("checkpoint-*"):
                shutil.rmtree(checkpoint)
            return seconds

        return self.run_cached_stage(
            f"finetune {name} on {train_split}", "finetune", key, produce, resumable=True
        )

    def evaluate(
        self,
        name: str,
        model_dir: Path,
        retain_eval: Future | None,
        cache: bool,
        metrics: Sequence[str] | None = None,
        key: Sequence[str] | None = None,
    ) -> Path:
        """Stock evaluation against Retain's, once `retain_eval` gives its eval file (None: Retain itself).

        metrics: Hydra overrides that choose the metrics (None: the stock set and the scorecard's paper
        metrics). key: with `cache`, what identifies the model instead of its weights' digest (so that the
        weights may be deleted once evaluated).
        """
        retain_logs = retain_eval.result() if retain_eval is not None else None
        experiment = f"eval/{self.facts.name.lower()}/tiny"
        batch = self.size.eval_batch_size
        overrides = [
            f"experiment={experiment}",
            "+runtime=cpu",
            *(self.model_overrides(training=False) if self.size.model_config != "tiny-llama" else []),
            *([f"eval.{self.facts.name.lower()}.batch_size={batch}"] if batch else []),
            *self.benchmark_overrides(),
            *(self.facts.scorecard.metric_overrides(cuda=False) if metrics is None else metrics),
            f"retain_logs_path={retain_logs or 'null'}",
            f"task_name={name}_eval",
        ]

        def produce(out_dir: Path) -> float:
            arguments = [*overrides, *model_paths(model_dir), f"paths.output_dir={out_dir}"]
            return run_framework("eval", arguments, self.run_dir / "logs" / f"eval_{name}.log", self.env)

        stage = f"evaluate {name}"
        if cache:
            key = [
                *(key or [file_digest(model_dir / "model.safetensors")]),
                *self.benchmark_digest(),
                file_digest(CONFIG_DIR / "experiment" / f"{experiment}.yaml"),
                *overrides,
            ]
            out_dir, _ = self.run_cached_stage(stage, "eval", key, produce)
        else:
            out_dir = self.run_dir / "evals" / name
            self.progress.say(f"{stage} …")
            self.progress.stage(stage, produce(out_dir))
        return out_dir / self.facts.eval_file

    def benchmark_digest(self) -> list[str]:
        return [file_digest(*self.data_dir().glob("*.json"))]

    def unlearn_and_evaluate(
        self, method: str, learning_rate: float, original_dir: Path, retain_eval: Future, extra=(), name=None
    ):
        """Unlearn Original with `method`, then evaluate; return (eval file, unlearning seconds)."""
        unlearned_dir, seconds = self.unlearn(method, learning_rate, original_dir, extra, name)
        return self.evaluate(unlearned_dir.name, unlearned_dir, retain_eval, cache=False), seconds

    def unlearn_overrides(
        self, method: str, learning_rate: float, original_dir: Path, out_dir: Path, extra=(), spans=None
    ) -> list[str]:
        """The framework's train.py command line that unlearns Original with `method` (METHODS); `extra`
        overrides come last (a knob's value, an ablation point); `spans`: another span file than the
        benchmark's."""
        span_file = spans or self.benchmark.span_annotations
        spans = [f"span_annotations={span_file}"] if METHODS[method].uses_spans else []
        idk = [f"idk_path={self.benchmark.idk_answers}"] if METHODS[method].uses_idk_answers else []
        return [
            "--config-name=unlearn.yaml",
            *self.method_overrides(method),
            *spans,
            *idk,
            *CPU_TRAINING,
            *self.model_overrides(training=True),
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
        name = name or unlearning_run_name(method, {"lr": learning_rate})
        out_dir = self.run_dir / "unlearn" / name
        overrides = self.unlearn_overrides(method, learning_rate, original_dir, out_dir, extra)
        self.progress.say(f"unlearn {name} …")
        seconds = run_framework("train", overrides, self.run_dir / "logs" / f"unlearn_{name}.log", self.env)
        self.progress.stage(f"unlearn {name}", seconds)
        return out_dir, seconds

    def unlearn_cached(
        self, method: str, learning_rate: float, original_dir: Path, extra=(), name=None, spans=None
    ) -> tuple[Path, float]:
        """`unlearn`, once per content key (the recipe that made Original, the data, the spans, this plugin's
        configs, the command line): a stopped experiment that runs again continues from the runs it finished.
        Original is keyed by its stage folder, named by its recipe (`finetune`), not by its weights: a run
        continued on another CPU, which finetunes Original again with different rounding, keeps its
        finished runs (stage_archive.py)."""
        name = name or unlearning_run_name(method, {"lr": learning_rate})
        command = self.unlearn_overrides(method, learning_rate, original_dir, Path(name), extra, spans)
        span_file = spans or self.benchmark.span_annotations
        key = [
            original_dir.name,
            *self.benchmark_digest(),
            *([file_digest(span_file)] if METHODS[method].uses_spans else []),
            config_digest(),
            *command,
        ]

        def produce(out_dir: Path) -> float:
            overrides = self.unlearn_overrides(method, learning_rate, original_dir, out_dir, extra, spans)
            # checkpoints that resume (not part of the key): a run stopped with its session continues from
            # its last epoch's checkpoint; only the newest keeps its optimizer state
            overrides.append("trainer.args.save_only_model=false")
            if resumable_checkpoint(out_dir):
                overrides.append("+trainer.args.resume_from_checkpoint=true")
                self.progress.say(f"unlearn {name}: resuming from {resumable_checkpoint(out_dir)}")
            else:
                shutil.rmtree(out_dir, ignore_errors=True)
            with pruning_optimizer_state(out_dir):
                return run_framework(
                    "train", overrides, self.run_dir / "logs" / f"unlearn_{name}.log", self.env
                )

        return self.run_cached_stage(f"unlearn {name}", "unlearn", key, produce, resumable=True)


class MuseStages(Stages):
    """The MUSE miniature's runs: the local MUSE-News subset as `MUSE_DIR`, raw text in `max_length`
    chunks."""

    facts = MUSE
    subset = "News"  # the miniature is a subset of MUSE-News (benchmarks.muse_subset)

    def data_dir(self) -> Path:
        return self.benchmark.muse_dir

    def split_files(self, train_split: str) -> list[Path]:
        return [self.benchmark.muse_dir / "raw" / f"{train_split}.jsonl"]

    def benchmark_digest(self) -> list[str]:
        return [file_digest(*self.benchmark.muse_dir.glob("*/*.jsonl"))]

    def benchmark_overrides(self) -> list[str]:
        return [f"max_new_tokens={self.size.eval_max_new_tokens}"]

    def method_overrides(self, method: str) -> list[str]:
        forget = "MUSE_forget_spans" if METHODS[method].uses_spans else "MUSE_forget"
        return [
            *self.facts.method_overrides(method),
            f"data.forget.{forget}.args.max_length={self.size.max_length}",
            f"data.retain.MUSE_retain.args.max_length={self.size.max_length}",
        ]


def start_run(bench: str, data: str, size_name: str, run_dir: Path, stages: int) -> Progress:
    """The run folder and the progress lines of a run with `stages` stages besides the miniature's."""
    progress = Progress(total_stages=MINIATURE_STAGES + stages)
    shutil.rmtree(run_dir / "datasets-cache", ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    progress.say(f"bench={bench}, data={data}, size={size_name}, output {run_dir}")
    return progress


def make_model(
    run_dir: Path, texts: list[str], size: Size, seed: int, progress: Progress
) -> tuple[Path, int]:
    """The tokenizer and tiny Llama; returns their folder and the vocabulary size they reached."""
    start = time.monotonic()
    model_dir = save_tiny_model(
        run_dir / "tiny-llama",
        texts,
        vocab_size=size.max_vocab_size,
        hidden_size=size.hidden_size,
        num_layers=size.num_layers,
        seed=seed,
    )
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    progress.stage(
        f"tokenizer + Llama ({size.num_layers} layers, hidden {size.hidden_size})", time.monotonic() - start
    )
    return model_dir, vocab_size


@dataclass(kw_only=True)
class Miniature:
    """What every experiment on a miniature starts from: Original and Retain, finetuned (or cached), and
    their evaluations running on the pool (`*_eval` are futures of eval files; `retain_eval` is what
    `Stages.evaluate` waits for). `notes`: the report's lines on data and model."""

    stages: Stages
    vocab_size: int
    original_dir: Path
    original_seconds: float
    retain_seconds: float
    original_eval: Future
    retain_eval: Future
    notes: list[str]

    def references(self) -> dict[str, report.EvaluatedModel]:
        size, scorecard = self.stages.size, self.stages.facts.scorecard
        params = {"lr": size.finetune_learning_rate, "epochs": size.finetune_epochs}
        return report.references(
            report.run_from_eval(self.original_eval.result(), self.original_seconds, params, scorecard),
            report.run_from_eval(self.retain_eval.result(), self.retain_seconds, params, scorecard),
            scorecard,
        )

    def unlearn_and_evaluate(self, method: str, learning_rate: float, extra=(), name=None):
        """Unlearn Original (`Stages.unlearn_and_evaluate`), evaluated against Retain."""
        return self.stages.unlearn_and_evaluate(
            method, learning_rate, self.original_dir, self.retain_eval, extra, name
        )


def finetune_references(
    stages: Stages, model_dir: Path, retain_split: str, vocab_size: int, pool, notes: list[str]
) -> Miniature:
    """Finetune Original on `full` and Retain on `retain_split` (or take them from the cache) and submit
    their evaluations. Single-threaded framework processes run `jobs` at a time on `pool`; every wait is on
    a job submitted earlier, which already holds a worker, so the pool cannot deadlock."""
    original = pool.submit(stages.finetune, "Original", model_dir, "full")
    retain = pool.submit(stages.finetune, "Retain", model_dir, retain_split)
    (original_dir, original_seconds), (retain_dir, retain_seconds) = original.result(), retain.result()
    # keyed by their recipes (stage folders), as the unlearning runs are (`Stages.unlearn_cached`)
    retain_eval = pool.submit(stages.evaluate, "Retain", retain_dir, None, True, key=[retain_dir.name])
    original_eval = pool.submit(
        stages.evaluate, "Original", original_dir, retain_eval, True, key=[original_dir.name]
    )
    return Miniature(
        stages=stages,
        vocab_size=vocab_size,
        original_dir=original_dir,
        original_seconds=original_seconds,
        retain_seconds=retain_seconds,
        original_eval=original_eval,
        retain_eval=retain_eval,
        notes=notes,
    )


def model_note(size: Size, vocab_size: int) -> str:
    """The report's line on the model the miniature trains from scratch."""
    return (
        f"Model: Llama from scratch, {size.num_layers} layers, hidden {size.hidden_size}, byte-level BPE "
        f"vocabulary {vocab_size} (trained for at most {size.max_vocab_size})"
    )


def real_model(size: RealTofuSize, progress: Progress) -> tuple[Path, int]:
    """The converted folder of the size's real pretrained model and its vocabulary size."""
    model_dir = smollm2.default_dir()
    if smollm2.read_marker(model_dir) is None:
        raise SystemExit(f"{size.model_config} is not converted at {model_dir}: run `make smollm2`")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    progress.stage(f"model: {size.model_config} from {model_dir}", 0)
    return model_dir, vocab_size


def tofu_miniature(args: argparse.Namespace, progress: Progress, pool) -> Miniature:
    """The TOFU miniature that the command line (`parse_arguments`) names: synthetic authors or a real-TOFU
    subset, its tokenizer and tiny Llama (or a real model, `--model`), Original and Retain."""
    size = TOFU_SIZES[args.size]
    start = time.monotonic()
    data_dir = args.run_dir / "data"
    if args.data == "synthetic":
        benchmark = synthetic_benchmark(data_dir, size.synthetic_authors, size.eval_max_new_tokens, args.seed)
    elif isinstance(size, RealTofuSize):
        benchmark = make_tofu_subset(args.tofu_dir, args.spans, data_dir, size.layout, args.other_spans)
    else:
        benchmark = make_tofu_subset(args.tofu_dir, args.spans, data_dir)
    progress.stage(f"data: {benchmark.description}", time.monotonic() - start)
    if isinstance(size, RealTofuSize):
        model_dir, vocab_size = real_model(size, progress)
        model = f"{size.model_config} (pretrained)"
    else:
        model_dir, vocab_size = make_model(args.run_dir, benchmark_texts(data_dir), size, args.seed, progress)
        model = model_note(size, vocab_size)
    notes = [
        f"Data: {benchmark.description}; forget split {benchmark.forget_split}, retain split "
        f"{benchmark.retain_split}, holdout {benchmark.holdout_split}.",
        f"{model}; unlearning starts from Original and runs {size.unlearn_epochs} "
        f"epochs, batch {size.unlearn_batch_size}.",
        "Retain's FQ is the KS test of its truth ratios against themselves, 1 by definition; its "
        "privleak uses the stock reference AUC of 0.5.",
    ]
    if not isinstance(size, RealTofuSize):
        notes.append(
            "Stock MU is the harmonic mean of nine parts, six on real-author and world-fact questions that "
            "a model trained from scratch cannot answer: one part near 0 collapses it, so it is ≈ 0 (and "
            "noise) for these models."
        )
    if args.data == "synthetic":
        notes.append(
            "real_authors / world_facts are synthetic stand-ins (palu_lab.benchmarks.synthetic_tofu)."
        )
    stages = Stages(benchmark, size, args.run_dir, args.results / ".cache", progress)
    stages.render_only = getattr(args, "render", False)
    return finetune_references(stages, model_dir, benchmark.retain_split, vocab_size, pool, notes)


def muse_miniature(args: argparse.Namespace, muse_dir: Path, progress: Progress, pool) -> Miniature:
    """The MUSE miniature: a subset of the MUSE-News folder `muse_dir` with spans from the annotator, its
    tokenizer and tiny Llama, Original and Retain. `notes` stay empty: the demo's say what it runs."""
    size = MUSE_SIZES[args.size]
    start = time.monotonic()
    benchmark = make_muse_subset(
        muse_dir,
        args.run_dir / "data",
        size.article_runs,
        size.retain_excerpts,
        size.holdout_excerpts,
        args.run_dir / "spans.jsonl",
    )
    progress.stage(f"data: {benchmark.description}", time.monotonic() - start)
    model_dir, vocab_size = make_model(args.run_dir, benchmark.texts(), size, args.seed, progress)
    stages = MuseStages(benchmark, size, args.run_dir, args.results / ".cache", progress)
    _, retain_split, _ = MUSE.splits[MuseStages.subset]
    return finetune_references(stages, model_dir, retain_split, vocab_size, pool, [])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every experiment on the miniature: data, size, output, parallelism."""
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
    parser.add_argument(
        "--model",
        choices=("tiny", *REAL_MODELS),
        default="tiny",
        help="tiny: a tokenizer and Llama from scratch; smollm2: SmolLM2-135M-Instruct on real TOFU",
    )


def parse_arguments(parser: argparse.ArgumentParser, argv, experiment: str):
    """Parse; the spans default for --data tofu; `args.size`: full or fast; `args.run_dir`: results/<--run>,
    by default results/<experiment>[-<data>][-fast] (the demo: results/<data>[-fast], its `--bench muse`
    data named muse)."""
    args = parser.parse_args(argv)
    if args.model != "tiny":
        # a real model on real TOFU; its PALU row uses the project's spans, an extra row GPT-4o's
        if args.data != "tofu":
            parser.error(f"--model {args.model} needs --data tofu --tofu-dir ... (MINI_MODEL=... DATA=tofu)")
        args.other_spans = {"gpt4o": args.tofu_dir.parent / "tofu_spans_gpt4o" / "forget05.jsonl"}
        args.spans = args.spans or PROJECT_ROOT / "span_annotations" / "tofu_forget05.jsonl"
    if args.data == "tofu":
        if not args.tofu_dir:
            parser.error("--data tofu needs --tofu-dir (DATA=tofu TOFU_DIR=...)")
        args.spans = args.spans or args.tofu_dir.parent / "tofu_spans_gpt4o" / "forget05.jsonl"
    args.size = "fast" if args.fast else "full"
    if args.model != "tiny":
        args.size = args.model + ("-fast" if args.fast else "")
    data = "muse" if getattr(args, "bench", "tofu") == "muse" else args.data
    model = "" if args.model == "tiny" else args.model
    parts = (experiment, model, "" if experiment and data == "synthetic" else data)
    name = "-".join(part for part in parts if part)
    args.run_dir = args.results / (args.run or name + ("-fast" if args.fast else ""))
    return args
