"""palu-recipe's command line (`experiments.recipe.main` runs it): the recipe's options, its inputs and how
it runs, and the `kit` subcommand."""

import argparse
import os
from pathlib import Path

from palu_trainer.experiments.ablation_axes import AXES
from palu_trainer.experiments.benchmark_facts import BENCHMARKS, MUSE, TOFU
from palu_trainer.experiments.methods import METHODS


def arguments(description: str) -> argparse.ArgumentParser:
    """palu-recipe's command line: the recipe's options, and the `kit` subcommand."""
    parser = argparse.ArgumentParser(prog="palu-recipe", description=description)
    parser.add_argument("--bench", choices=list(BENCHMARKS), default="tofu")
    parser.add_argument("--forget", choices=sorted(TOFU.splits), default="05", help="TOFU's forget split")
    parser.add_argument("--split", choices=list(MUSE.splits), default="News", help="MUSE's corpus")
    parser.add_argument(
        "--model", help="a framework model config name (default: Llama-2-7b-chat-hf; MUSE: Llama-2-7b-hf)"
    )
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
    add_inputs_and_runs(parser)
    commands = parser.add_subparsers(dest="command", title="subcommands")
    kit = commands.add_parser(
        "kit",
        help="palu-recipe kit DIR: write PALU's and TPO's folders in the framework's contribution format "
        "(community/methods/<NAME>/README.md and run.sh) into the open-unlearning checkout DIR",
    )
    kit.add_argument("checkout", type=Path, help="an open-unlearning checkout")
    return parser


def add_inputs_and_runs(parser: argparse.ArgumentParser) -> None:
    """The recipe's inputs (models, logs, answers, attention) and how it runs (report, grid, LoRA, plan)."""
    parser.add_argument("--model-dir", default=os.environ.get("MODEL_DIR") or None)
    parser.add_argument("--retain-logs", default=os.environ.get("RETAIN_LOGS") or None)
    parser.add_argument(
        "--original-logs",
        default=os.environ.get("ORIGINAL_LOGS") or None,
        help="the Original (target) model's evaluation for --report (default: where the framework has it)",
    )
    parser.add_argument(
        "--attn",
        default=os.environ.get("ATTN") or "auto",
        choices=("auto", "flash_attention_2", "sdpa", "eager"),
        help="attention of every run; auto: the model config's, sdpa (with a warning) where it asks for "
        "flash_attention_2 and flash-attn cannot run",
    )
    parser.add_argument(
        "--idk-answers", default=os.environ.get("IDK_ANSWERS") or None, help="DPO's idk.jsonl"
    )
    parser.add_argument("--report", type=Path, help="write a comparison table, JSON and plot here")
    parser.add_argument(
        "--tune",
        action="store_true",
        help="equal budget: every method at the paper's learning rates x its own knob (methods.Knob)",
    )
    parser.add_argument(
        "--ablation", choices=list(AXES), help="PALU at every point of one of the paper's ablation axes"
    )
    parser.add_argument(
        "--lora", action="store_true", help="LoRA adapters on every run's model (+peft=lora, docs/lora.md)"
    )
    parser.add_argument(
        "--best-model",
        choices=("fq_at_mu_floor", "fq_mu_mean"),
        help="evaluate every run after each epoch and keep the epoch this rule picks (configs/best_model/)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan only")
