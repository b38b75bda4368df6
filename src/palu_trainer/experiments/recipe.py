"""The paper's TOFU recipe through the framework: unlearn, then the stock TOFU evaluation.

`make tofu FORGET=05` runs PALU; `make compare FORGET=05` runs every method of the side-by-side table
(palu_trainer.experiments.methods) and renders one table; `make tofu-ablation AXIS=k|n|c|strategy` runs PALU
at every point of one of the paper's ablation axes (palu_trainer.experiments.ablation.AXES).
Hyperparameters follow the paper's appendix: 10 epochs, global batch 32, paged AdamW, one warm-up epoch,
lr 1e-5 (grid 1e-5, 2e-5, 5e-5), PALU K=5000, N=3, c=global mean, λ=1 (grid 1, 2, 5, 10); NPO and
SimNPO keep the framework's stock method arguments.
"""

import argparse
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from palu_trainer.benchmarks.hf_dir import read_configs
from palu_trainer.experiments import report
from palu_trainer.experiments.ablation import AXES, METHOD, slug
from palu_trainer.experiments.methods import METHODS, side_by_side_methods, tofu_overrides
from palu_trainer.framework.checkout import checkout_dir
from palu_trainer.framework.plugin import write_accelerate_config

GLOBAL_BATCH = 32
PER_DEVICE_BATCH = 4
SPLITS = {"01": ("forget01", "retain99", "holdout01"), "05": ("forget05", "retain95", "holdout05"),
          "10": ("forget10", "retain90", "holdout10")}  # fmt: skip


@dataclass(frozen=True)
class RecipeSettings:
    """One recipe invocation: split, model, GPUs and the swept hyperparameters."""

    forget: str
    model: str
    gpus: int
    learning_rate: str = "1e-5"
    kl_weight: str = "1.0"
    model_dir: str | None = None
    retain_logs: str | None = None
    variant: str = ""  # an ablation point: appended to the task name
    extra: tuple[str, ...] = ()  # its overrides, last on the unlearning command line

    @property
    def splits(self) -> tuple[str, str, str]:
        return SPLITS[self.forget]

    def task_name(self, method: str) -> str:
        suffix = f"_lr{self.learning_rate}" + (
            f"_lambda{self.kl_weight}" if METHODS[method].kl_weight_key else ""
        )
        variant = f"_{self.variant}" if self.variant else ""
        return f"tofu_{self.model}_{self.splits[0]}_{method}{suffix}{variant}"

    @property
    def model_path(self) -> str:
        return self.model_dir or f"open-unlearning/tofu_{self.model}_full"

    @property
    def retain_logs_path(self) -> str:
        return self.retain_logs or f"saves/eval/tofu_{self.model}_{self.splits[1]}/TOFU_EVAL.json"

    @property
    def original_logs_path(self) -> str:
        """The finetuned target's own evaluation, from the same `setup_data.py --eval_logs` download."""
        return f"saves/eval/tofu_{self.model}_full/TOFU_EVAL.json"

    def eval_path(self, method: str) -> Path:
        return Path("saves/unlearn") / self.task_name(method) / "evals" / "TOFU_EVAL.json"


BIN = Path(sys.executable).parent


def unlearn_command(run: RecipeSettings, method: str, accelerate_config: Path, port: int) -> list[str]:
    """One process with palu-train, or the framework's accelerate + ZeRO-3 launch on several GPUs."""
    forget, retain, holdout = run.splits
    launcher = [str(BIN / "palu-train")]
    if run.gpus > 1:
        accelerate = [str(BIN / "accelerate"), "launch", "--config_file", str(accelerate_config)]
        launcher = [*accelerate, "--main_process_port", str(port), *launcher]
    accumulation = max(1, GLOBAL_BATCH // (PER_DEVICE_BATCH * run.gpus))
    command = [
        *launcher,
        "--config-name=unlearn.yaml",
        *tofu_overrides(method),
        f"model={run.model}",
        f"forget_split={forget}",
        f"retain_split={retain}",
        f"holdout_split={holdout}",
        f"task_name={run.task_name(method)}",
        f"model.model_args.pretrained_model_name_or_path={run.model_path}",
        f"retain_logs_path={run.retain_logs_path}",
        f"trainer.args.per_device_train_batch_size={PER_DEVICE_BATCH}",
        f"trainer.args.gradient_accumulation_steps={accumulation}",
        f"trainer.args.learning_rate={run.learning_rate}",
        "trainer.args.gradient_checkpointing=true",
    ]
    if run.model_dir:
        command.append(f"model.tokenizer_args.pretrained_model_name_or_path={run.model_dir}")
    if METHODS[method].kl_weight_key:
        command.append(f"{METHODS[method].kl_weight_key}={run.kl_weight}")
    return [*command, *run.extra]


def eval_command(run: RecipeSettings, method: str) -> list[str]:
    forget, _, holdout = run.splits
    saved = f"saves/unlearn/{run.task_name(method)}"
    return [
        str(BIN / "palu-eval"),
        "experiment=eval/tofu/default",
        f"model={run.model}",
        f"forget_split={forget}",
        f"holdout_split={holdout}",
        f"task_name={run.task_name(method)}",
        f"model.model_args.pretrained_model_name_or_path={saved}",
        f"model.tokenizer_args.pretrained_model_name_or_path={saved}",
        f"paths.output_dir={run.eval_path(method).parent}",
        f"retain_logs_path={run.retain_logs_path}",
    ]


def missing_requirements(run: RecipeSettings, environ=os.environ, needs_original_logs=False) -> list[str]:
    """What this machine lacks for the real recipe, each with what to do; empty when ready."""
    import torch

    problems = []
    if needs_original_logs and not Path(run.original_logs_path).is_file():
        problems.append(f"{run.original_logs_path} not found: the comparison table's Original row needs it")
    if torch.cuda.device_count() < run.gpus:
        problems.append(
            f"{run.gpus} CUDA GPU(s) needed, {torch.cuda.device_count()} visible: the recipe fine-tunes a "
            f"{run.model} model"
        )
    if run.model_dir:
        if not (Path(run.model_dir) / "config.json").is_file():
            problems.append(
                f"MODEL_DIR={run.model_dir} has no config.json (save_pretrained weights expected)"
            )
    elif not _on_hub_or_cached(run.model_path, "model"):
        problems.append(
            f"model {run.model_path}: not in the Hugging Face cache and the hub is unreachable; set MODEL_DIR"
        )
    if environ.get("TOFU_DIR"):
        available = read_configs(Path(environ["TOFU_DIR"]))
        absent = [name for name in run.splits if name not in available]
        if absent:
            problems.append(f"TOFU_DIR={environ['TOFU_DIR']} lacks the configs {', '.join(absent)}")
    elif not _on_hub_or_cached("locuslab/TOFU", "dataset"):
        problems.append("dataset locuslab/TOFU: not cached and the hub is unreachable; set TOFU_DIR")
    if not Path(run.retain_logs_path).is_file():
        problems.append(
            f"retain model logs {run.retain_logs_path} not found (forget quality needs them): run "
            f"`python setup_data.py --eval_logs` in {checkout_dir()} and copy its saves/eval here, "
            "or set RETAIN_LOGS"
        )
    return problems


def _on_hub_or_cached(repo_id: str, repo_type: str) -> bool:
    from huggingface_hub import HfApi, try_to_load_from_cache

    filename = "config.json" if repo_type == "model" else "README.md"
    if isinstance(try_to_load_from_cache(repo_id, filename, repo_type=repo_type), str):
        return True
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=5)
        return True
    except Exception:  # offline, DNS failure, gated: all mean "cannot fetch it now"
        return False


def plan(run: RecipeSettings, methods: list[str], accelerate_config: Path) -> list[tuple[str, list[str]]]:
    port = _free_port()
    steps = []
    for method in methods:
        title = method + (f" {run.variant}" if run.variant else "")
        steps.append((f"{title}: unlearn", unlearn_command(run, method, accelerate_config, port)))
        steps.append((f"{title}: TOFU evaluation", eval_command(run, method)))
    return steps


def ablation_plan(run: RecipeSettings, axis: str, accelerate_config: Path) -> list[tuple[str, list[str]]]:
    """PALU at every point of one of the paper's ablation axes (experiments.ablation.AXES)."""
    steps = []
    for label, overrides in AXES[axis].points:
        variant = f"{axis}-{slug(label)}"
        steps += plan(replace(run, variant=variant, extra=overrides), [METHOD], accelerate_config)
    return steps


def write_comparison(
    run: RecipeSettings, methods: list[str], wall_times: dict[str, float], out_dir: Path
) -> dict:
    """One table, JSON and utility-vs-FQ plot of the methods' evaluations (experiments.report)."""
    references = {
        "Original": report.run_from_eval(run.original_logs_path),
        "Retain": report.run_from_eval(run.retain_logs_path),
    }
    references["Retain"].metrics["forget_quality"] = 1.0  # a KS test of Retain against itself
    grids = {
        method: [
            report.run_from_eval(
                run.eval_path(method),
                wall_times.get(method),
                {
                    "lr": run.learning_rate,
                    **({"lambda": run.kl_weight} if METHODS[method].kl_weight_key else {}),
                },
            )
        ]
        for method in methods
    }
    forget, retain, _ = run.splits
    return report.write_report(
        out_dir,
        references,
        grids,
        title=f"TOFU {forget}: {', '.join(methods)} on {run.model}",
        notes=[f"Retain: {run.retain_logs_path} ({retain}); Original: {run.original_logs_path}."],
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="palu-recipe", description=__doc__.splitlines()[0])
    parser.add_argument("--forget", choices=sorted(SPLITS), default="05")
    parser.add_argument("--model", default="Llama-2-7b-chat-hf", help="a framework model config name")
    parser.add_argument("--gpus", type=int, default=None, help="default: every visible CUDA GPU, at least 1")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["PALU"],
        choices=[*METHODS, "side-by-side"],
        help="methods to run; side-by-side: every method of the table (palu_trainer.experiments.methods)",
    )
    parser.add_argument("--lr", default="1e-5")
    parser.add_argument("--kl-weight", default="1.0", help="PALU's λ")
    parser.add_argument("--model-dir", default=os.environ.get("MODEL_DIR") or None)
    parser.add_argument("--retain-logs", default=os.environ.get("RETAIN_LOGS") or None)
    parser.add_argument("--report", type=Path, help="write a comparison table, JSON and plot here")
    parser.add_argument(
        "--ablation", choices=list(AXES), help="PALU at every point of one of the paper's ablation axes"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan only")
    args = parser.parse_args(argv)
    if args.ablation and args.report:
        parser.error("--ablation writes one TOFU evaluation per point; --report compares methods")
    if "side-by-side" in args.methods:
        args.methods = list(side_by_side_methods())
    import torch

    gpus = args.gpus or max(1, torch.cuda.device_count())
    run = RecipeSettings(
        args.forget, args.model, gpus, args.lr, args.kl_weight, args.model_dir, args.retain_logs
    )
    accelerate_dir = Path("saves/accelerate")
    accelerate_config = accelerate_dir / "accelerate.yaml"
    if args.ablation:
        steps = ablation_plan(run, args.ablation, accelerate_config)
        what = f"PALU ablation of {AXES[args.ablation].title}"
    else:
        steps = plan(run, args.methods, accelerate_config)
        what = ", ".join(args.methods)
    print(f"plan: TOFU forget{args.forget}, {args.model}, {gpus} GPU(s), {what}")
    for title, command in steps:
        print(f"# {title}\n{shlex.join(command)}")
    if args.dry_run:
        return
    problems = missing_requirements(run, needs_original_logs=args.report is not None)
    if problems:
        print(
            "\ncannot run the real recipe here:", *(f"  - {p}" for p in problems), sep="\n", file=sys.stderr
        )
        print(
            "On a CPU-only or offline machine, `make demo` runs the offline miniature instead.",
            file=sys.stderr,
        )
        sys.exit(2)
    if gpus > 1:
        write_accelerate_config(accelerate_dir, gpus)
    wall_times = {}
    for title, command in steps:
        started = time.monotonic()
        print(f"\n== {title}", flush=True)
        subprocess.run(command, check=True)
        seconds = time.monotonic() - started
        print(f"== {title}: {seconds:.0f} s", flush=True)
        if title.endswith("unlearn"):
            wall_times[title.split(":")[0]] = seconds
    if args.report:
        for label, path in write_comparison(run, args.methods, wall_times, args.report).items():
            print(f"{label}: {path}")


if __name__ == "__main__":
    main()
