"""The paper's TOFU and MUSE recipes through the framework: unlearn, then the stock evaluation.

`make tofu FORGET=05` runs PALU; `make compare FORGET=05` runs every method of the side-by-side table
(palu_trainer.experiments.methods) and renders one table; `--bench muse` (`make muse SPLIT=News`) does the
same on MUSE. The hyperparameters (the paper's appendix): docs/reproducing.md; MUSE's: docs/muse.md.
"""

import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from palu_trainer.benchmarks.hf_dir import read_configs
from palu_trainer.experiments import report
from palu_trainer.experiments.ablation_axes import ABLATED_METHOD, AXES
from palu_trainer.experiments.benchmark_facts import MUSE, MUSE_LOADS, TOFU
from palu_trainer.experiments.methods import METHODS, side_by_side_methods, tuning_grid
from palu_trainer.experiments.recipe_arguments import arguments
from palu_trainer.experiments.requirements import (
    choose_attention,
    dataset_on_hub_or_cached,
    missing_requirements,
)
from palu_trainer.framework import launch
from palu_trainer.framework.checkout import checkout_dir

GLOBAL_BATCH = 32
PAPER_LEARNING_RATES = (1e-5, 2e-5, 5e-5)
PER_DEVICE_BATCH = 4


@dataclass(frozen=True)
class RecipeSettings:
    """One recipe invocation on TOFU (`MuseRecipeSettings`: MUSE): split, model, GPUs, hyperparameters."""

    facts = TOFU
    forget: str  # the subset: a key of `facts.splits`
    model: str
    gpus: int
    learning_rate: str = "1e-5"
    kl_weight: str = "1.0"
    model_dir: str | None = None
    retain_logs: str | None = None
    idk_answers: str | None = None
    variant: tuple[tuple[str, str], ...] = ()  # (name, value) of a tuned knob or an ablation point
    extra: tuple[str, ...] = ()  # the variant's overrides, last on the unlearning command line
    original_logs: str | None = None
    # the attention every run uses, when it differs from the model config's (choose_attention)
    attn_implementation: str | None = None
    lora: bool = False  # +peft=lora: adapters on every method's model, the reference without a copy
    best_model: str | None = None  # +best_model=RULE: evaluate every epoch, keep the rule's pick

    @property
    def splits(self) -> tuple[str, str, str]:
        return self.facts.splits[self.forget]

    def task_name(self, method: str) -> str:
        params = "".join(f"_{name}{value}" for name, value in self.params(method).items())
        name = f"{self.task_prefix}_{method}{params}" + ("_lora" if self.lora else "")
        return re.sub(r"[^A-Za-z0-9._-]+", "-", name)

    def params(self, method: str) -> dict:
        """The report's hyperparameters of this run of `method`."""
        kl_weight = {"lambda": self.kl_weight} if METHODS[method].kl_weight_key else {}
        return {"lr": self.learning_rate, **kl_weight, **dict(self.variant)}

    @property
    def task_prefix(self) -> str:
        return f"tofu_{self.model}_{self.splits[0]}"

    @property
    def model_path(self) -> str:
        return self.model_dir or f"open-unlearning/tofu_{self.model}_full"

    @property
    def retain_logs_path(self) -> str:
        """Where the framework's `scripts/tofu_finetune.sh` evaluates the retain model (task_name
        tofu_<model>_<retain split>, eval's default output folder), as `setup_data.py --eval_logs` has it."""
        return self.retain_logs or self.framework_log(f"tofu_{self.model}_{self.splits[1]}")

    @property
    def original_logs_path(self) -> str:
        """Where `scripts/tofu_finetune.sh` evaluates the full (Original) model on this forget split:
        `paths.output_dir=saves/eval/tofu_<model>_full/evals_<forget split>`."""
        return self.original_logs or self.framework_log(f"tofu_{self.model}_full/evals_{self.splits[0]}")

    def framework_log(self, folder: str) -> str:
        """The evaluation log `saves/eval/<folder>/<eval file>`: here, else in the framework checkout (where
        its `setup_data.py --eval_logs` downloads them); the relative path if in neither (checks name it)."""
        relative = f"saves/eval/{folder}/{self.facts.eval_file}"
        if not Path(relative).is_file() and (checkout_dir() / relative).is_file():
            return str(checkout_dir() / relative)
        return relative

    @property
    def idk_answers_path(self) -> str:
        """DPO's "I don't know" answers: where the framework's `setup_data.py --idk` puts them."""
        return self.idk_answers or str(checkout_dir() / "data" / "idk.jsonl")

    @property
    def attention_overrides(self) -> list[str]:
        attention = self.attn_implementation
        return [f"model.model_args.attn_implementation={attention}"] if attention else []

    def eval_path(self, method: str) -> Path:
        return Path("saves/unlearn") / self.task_name(method) / "evals" / self.facts.eval_file

    def describe(self) -> str:
        return f"{self.facts.name} {self.splits[0]}"

    def data_overrides(self) -> list[str]:
        """What selects the data of the unlearning; the evaluation reads all of it but the retain split."""
        forget, retain, holdout = self.splits
        return [f"forget_split={forget}", f"retain_split={retain}", f"holdout_split={holdout}"]

    def dataset_problems(self, environ) -> list[str]:
        """Whether the runs can read the dataset: its local mirror if set, else the hub's cache or the hub."""
        hub_id, variable = self.facts.hub(self.forget), self.facts.mirror_variable(self.forget)
        if variable and environ.get(variable):
            absent = self.absent_from_mirror(read_configs(Path(environ[variable])))
            return [f"{variable}={environ[variable]} lacks {absent}"] if absent else []
        if not dataset_on_hub_or_cached(hub_id):
            mirror = f"; set {variable}" if variable else ""
            return [f"dataset {hub_id}: not cached and the hub is unreachable{mirror}"]
        return []

    def absent_from_mirror(self, available: dict[str, set[str]]) -> str:
        """What a local mirror offering `available` (config -> splits) lacks for these runs; "" if nothing."""
        absent = [name for name in self.splits if name not in available]
        return f"the configs {', '.join(absent)}" if absent else ""


@dataclass(frozen=True)
class MuseRecipeSettings(RecipeSettings):
    """MUSE: `forget` is the corpus (News or Books); the model is the framework's MUSE target."""

    facts = MUSE

    @property
    def task_prefix(self) -> str:
        return f"muse_{self.model}_{self.forget}"

    @property
    def model_path(self) -> str:
        return self.model_dir or f"{self.facts.hub(self.forget)}_target"

    @property
    def retain_logs_path(self) -> str:
        """As `scripts/muse_unlearn.sh` passes it (`setup_data.py --eval_logs` has it there)."""
        return self.retain_logs or self.framework_log(f"muse_{self.model}_{self.forget}_retrain")

    @property
    def original_logs_path(self) -> str:
        """The target's logs in the same download (no framework script writes them)."""
        return self.original_logs or self.framework_log(f"muse_{self.model}_{self.forget}_target")

    def describe(self) -> str:
        return f"{self.facts.name}-{self.forget}"

    def data_overrides(self) -> list[str]:
        return [f"data_split={self.forget}"]

    def absent_from_mirror(self, available: dict[str, set[str]]) -> str:
        return ", ".join(
            f"{config}/{split}"
            for config, splits in MUSE_LOADS.items()
            for split in splits
            if split not in available.get(config, ())
        )


def unlearn_command(settings: RecipeSettings, method: str, accelerate_config: Path) -> list[str]:
    """One process with palu-train, or the framework's accelerate + ZeRO-3 launch on several GPUs."""
    launcher = launch.command("palu-train", accelerate_config if settings.gpus > 1 else None)
    accumulation = max(1, GLOBAL_BATCH // (PER_DEVICE_BATCH * settings.gpus))
    command = [
        *launcher,
        "--config-name=unlearn.yaml",
        *settings.facts.method_overrides(method),
        f"model={settings.model}",
        *settings.data_overrides(),
        f"task_name={settings.task_name(method)}",
        f"model.model_args.pretrained_model_name_or_path={settings.model_path}",
        f"retain_logs_path={settings.retain_logs_path}",
        f"trainer.args.per_device_train_batch_size={PER_DEVICE_BATCH}",
        f"trainer.args.gradient_accumulation_steps={accumulation}",
        f"trainer.args.learning_rate={settings.learning_rate}",
        "trainer.args.gradient_checkpointing=true",
        *settings.attention_overrides,
    ]
    if settings.model_dir:
        command.append(f"model.tokenizer_args.pretrained_model_name_or_path={settings.model_dir}")
    if METHODS[method].kl_weight_key:
        command.append(f"{METHODS[method].kl_weight_key}={settings.kl_weight}")
    if METHODS[method].uses_idk_answers:
        command.append(f"idk_path={settings.idk_answers_path}")
    if settings.lora:
        command.append("+peft=lora")
    if settings.best_model:
        command.append(f"+best_model={settings.best_model}")
    return [*command, *settings.extra]


def eval_command(settings: RecipeSettings, method: str) -> list[str]:
    saved = f"saves/unlearn/{settings.task_name(method)}"
    return [
        *launch.command("palu-eval"),
        f"experiment={settings.facts.eval_experiment}",
        f"model={settings.model}",
        *(data for data in settings.data_overrides() if not data.startswith("retain_split=")),
        *settings.facts.scorecard.metric_overrides(cuda=True),
        f"task_name={settings.task_name(method)}",
        f"model.model_args.pretrained_model_name_or_path={saved}",
        f"model.tokenizer_args.pretrained_model_name_or_path={saved}",
        f"paths.output_dir={settings.eval_path(method).parent}",
        f"retain_logs_path={settings.retain_logs_path}",
        *settings.attention_overrides,
    ]


def method_runs(settings: RecipeSettings, methods: list[str], tune: bool) -> list[tuple[str, RecipeSettings]]:
    """(method, settings) of every run. `tune`: the equal budget, the paper's learning rates x the method's
    knob (methods.Knob; PALU's is λ); a method without a knob gets as many learning rates."""
    if not tune:
        return [(method, settings) for method in methods]
    runs = []
    for method in methods:
        for rate, params, extra in tuning_grid(method, PAPER_LEARNING_RATES, tune_knobs=True):
            knob = METHODS[method].knob
            if knob and knob.key == METHODS[method].kl_weight_key:
                tuned = replace(settings, kl_weight=f"{params[knob.name]:g}")
            else:
                variant = tuple((name, f"{value:g}") for name, value in params.items() if name != "lr")
                tuned = replace(settings, variant=variant, extra=extra)
            runs.append((method, replace(tuned, learning_rate=f"{rate:g}")))
    return runs


def plan(runs: list[tuple[str, RecipeSettings]], accelerate_config: Path) -> list[tuple[str, list[str]]]:
    steps = []
    for method, settings in runs:
        title = settings.task_name(method)
        steps.append((f"{title}: unlearn", unlearn_command(settings, method, accelerate_config)))
        steps.append((f"{title}: {settings.facts.name} evaluation", eval_command(settings, method)))
    return steps


def write_comparison(
    runs: list[tuple[str, RecipeSettings]], wall_times: dict[str, float], out_dir: Path
) -> dict:
    """One table, JSON and utility-vs-FQ plot of the runs' evaluations (experiments.report); `wall_times`:
    unlearning seconds by task name."""
    shared = runs[0][1]  # benchmark, model and reference logs are every run's
    scorecard = shared.facts.scorecard
    references = report.references(
        report.run_from_eval(shared.original_logs_path, scorecard=scorecard),
        report.run_from_eval(shared.retain_logs_path, scorecard=scorecard),
        scorecard,
    )
    grids = {}
    for method, settings in runs:
        evaluated = report.run_from_eval(
            settings.eval_path(method),
            wall_times.get(settings.task_name(method)),
            settings.params(method),
            scorecard,
        )
        grids.setdefault(method, []).append(evaluated)
    budget = ", ".join(f"{method} {len(evaluated)}" for method, evaluated in grids.items())
    return report.write_report(
        out_dir,
        references,
        grids,
        title=f"{shared.describe()}: {', '.join(grids)} on {shared.model}",
        notes=[
            f"Retain: {shared.retain_logs_path} ({shared.splits[1]}); Original: {shared.original_logs_path}.",
            f"Runs per method: {budget} (hyperparameters in the table of every run).",
        ],
        scorecard=scorecard,
    )


def planned_runs(args, settings) -> tuple[list, str]:
    """The (method, settings) runs that `args` ask for, and what they are in words."""
    if args.ablation:
        runs = [
            (ABLATED_METHOD, replace(settings, variant=((args.ablation, label),), extra=overrides))
            for label, overrides in AXES[args.ablation].points.items()
        ]
        return runs, f"PALU ablation, {AXES[args.ablation].title}"
    what = ", ".join(args.methods) + (" (lr x knob grid)" if args.tune else "")
    return method_runs(settings, args.methods, args.tune), what


def refuse_what_is_missing(settings, args, attention_problems) -> None:
    """Exit 2 listing every requirement the runs lack (GPUs, model access, data, logs), before any runs."""
    problems = attention_problems + missing_requirements(
        settings,
        needs_original_logs=args.report is not None,
        needs_idk_answers=any(METHODS[method].uses_idk_answers for method in args.methods),
    )
    if problems:
        listed = "".join(f"\n  - {problem}" for problem in problems)
        offline = "On a CPU-only or offline machine, `make demo` runs the offline miniature instead."
        print(f"\ncannot run the real recipe here:{listed}\n{offline}", file=sys.stderr)
        sys.exit(2)


def run_steps(steps) -> dict[str, float]:
    """Run each (title, command) in turn; the wall time of each method's unlearning run."""
    wall_times = {}
    for title, command in steps:
        started = time.monotonic()
        print(f"\n== {title}", flush=True)
        subprocess.run(command, check=True)
        seconds = time.monotonic() - started
        print(f"== {title}: {seconds:.0f} s", flush=True)
        if title.endswith("unlearn"):
            wall_times[title.split(":")[0]] = seconds
    return wall_times


def main(argv=None) -> None:
    parser = arguments(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    if args.command == "kit":
        from palu_trainer.experiments.kit import write_kit_into

        return write_kit_into(args.checkout)
    if args.ablation and (args.tune or args.methods != ["PALU"]):
        parser.error("--ablation runs PALU's points alone: no --tune, no --methods")
    if "side-by-side" in args.methods:
        args.methods = list(side_by_side_methods(bench=args.bench))
    import torch

    gpus = args.gpus or max(1, torch.cuda.device_count())
    muse = args.bench == "muse"
    settings_class, subset = (MuseRecipeSettings, args.split) if muse else (RecipeSettings, args.forget)
    model = args.model or ("Llama-2-7b-hf" if muse else "Llama-2-7b-chat-hf")
    attention, warnings, attention_problems = choose_attention(model, args.attn)
    passed = ("kl_weight", "model_dir", "retain_logs", "idk_answers", "original_logs", "lora", "best_model")
    passed = {key: vars(args)[key] for key in passed}  # the options named as RecipeSettings' fields
    settings = settings_class(subset, model, gpus, args.lr, attn_implementation=attention, **passed)
    accelerate_dir = Path("saves/accelerate")
    runs, what = planned_runs(args, settings)
    steps = plan(runs, accelerate_dir / "accelerate.yaml")
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    print(f"plan: {settings.describe()}, {model}, {gpus} GPU(s), {what}: {len(runs)} runs")
    for title, command in steps:
        print(f"# {title}\n{shlex.join(command)}")
    if args.dry_run:
        return
    refuse_what_is_missing(settings, args, attention_problems)
    if gpus > 1:
        launch.write_accelerate_config(accelerate_dir, gpus)
    wall_times = run_steps(steps)
    if args.report:
        for label, path in write_comparison(runs, wall_times, args.report).items():
            print(f"{label}: {path}")


if __name__ == "__main__":
    main()
