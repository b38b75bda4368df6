"""Where an unlearned model's damage lands (issue 59): `python -m palu_lab.damage --reference DIR
--checkpoint LABEL=DIR ... --data-dir DIR`, or, for runs of the converged experiment, `python -m
palu_lab.damage --converged-runs NAME ... --tofu-dir DIR`.

Forward passes only. On the answers of the first `--rows` rows of each set that model utility reads (retain,
real authors, world facts), at every answer token t: KL(P_ref(·|prefix) ‖ P_θ(·|prefix)) of the distributions
that predict it, and the shift of the mean logit, mean_V z_θ − mean_V z_ref (a move of every logit together,
which the softmax ignores). Tokens are split by their role under the plugin's own annotation of these
answers (the annotator of `palu-annotate`, first 3 tokens of each span initiating): where a name or fact
begins (initiating), the rest of a span (redundant), and the tokens outside every span (common).

Printed per model and set: the mean KL per role with its token count, and the mean-logit shift's mean and
mean absolute value; with `--json`, the same as a file.

`--converged-runs`: tuning runs of the converged experiment by name (`converged.py --plan` lists them).
Their stages there keep no weights, so each runs again, the same command in a stage named `<run>-damage`
(cached in results/.cache, resumable), and every evaluated epoch's checkpoint is measured against Original
on the experiment's own utility sets (40 rows each).
"""

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from palu_lab import converged, miniature
from palu_trainer.framework.checkout import CONFIG_DIR, PROJECT_ROOT
from palu_trainer.framework.datasets import QAwithSpansDataset
from palu_trainer.method.roles import TokenRole, predicting_rows
from palu_trainer.spans.annotator import Background, annotate
from palu_trainer.spans.format import write_annotations

# The sets that model utility reads, as the evaluator names its files: the trained retain authors' answers,
# real authors and world facts (each `*_perturbed` file holds the rows with their answers).
UTILITY_SETS = ("retain_perturbed", "real_authors_perturbed", "world_facts_perturbed")
ROLES = (TokenRole.INITIATING, TokenRole.REDUNDANT, TokenRole.COMMON)


@dataclass(frozen=True)
class RoleDamage:
    """KL(P_ref ‖ P_θ) at the answer tokens of one role: its mean and the number of tokens."""

    mean_kl: float | None
    tokens: int


@dataclass(frozen=True)
class SetDamage:
    """One model on one set: KL by role (`ROLES`' names, lower case) and over all answer tokens, and the
    mean-logit shift over all answer tokens (mean and mean absolute value)."""

    rows: int
    by_role: dict[str, RoleDamage]
    all_tokens: RoleDamage
    mean_logit_shift: float
    mean_absolute_logit_shift: float


def annotated_dataset(
    data_dir: Path, name: str, rows: int, tokenizer, template_args: dict, spans_dir: Path
) -> QAwithSpansDataset:
    """The first `rows` rows of `data_dir/name.json` with the annotator's spans (written to `spans_dir`)."""
    lines = (data_dir / f"{name}.json").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines[:rows]]
    background = Background(f"{record['question']}\n{record['answer']}" for record in records)
    spans = annotate(records, background, "question", "answer")
    span_file = spans_dir / f"{name}.jsonl"
    write_annotations(span_file, [record["answer"] for record in records], spans)
    return QAwithSpansDataset(
        span_annotations=span_file,
        hf_args={"path": "json", "data_files": str(data_dir / f"{name}.json"), "split": f"train[:{rows}]"},
        template_args=template_args,
        tokenizer=tokenizer,
    )


def answer_logits(model, item: dict) -> torch.Tensor:
    """(T, V) float32 logits of one tokenised row."""
    with torch.no_grad():
        outputs = model(input_ids=item["input_ids"][None], attention_mask=item["attention_mask"][None])
    return outputs.logits[0].float()


@dataclass(frozen=True)
class ReferenceAnswers:
    """The reference on one set, computed once for every model measured against it: per row, the answer
    positions by role (`ROLES`' order), and at them the reference's log-probabilities (A, V) and mean logit
    (A,)."""

    positions: list[dict[TokenRole, torch.Tensor]]
    log_probs: list[torch.Tensor]
    mean_logits: list[torch.Tensor]


def answered(positions: dict[TokenRole, torch.Tensor]) -> torch.Tensor:
    return torch.cat([positions[role] for role in ROLES])


def reference_answers(reference, dataset: QAwithSpansDataset) -> ReferenceAnswers:
    positions, log_probs, mean_logits = [], [], []
    for index in range(len(dataset)):
        item = dataset[index]
        roles = item["token_roles"][None]
        positions.append({role: predicting_rows(roles, role) for role in ROLES})
        logits = answer_logits(reference, item)[answered(positions[-1])]
        log_probs.append(logits.log_softmax(-1))
        mean_logits.append(logits.mean(-1))
    return ReferenceAnswers(positions, log_probs, mean_logits)


def set_damage(model, reference: ReferenceAnswers, dataset: QAwithSpansDataset) -> SetDamage:
    """`model` against the reference's answers on every row of `dataset` (see the module's docstring)."""
    kl_by_role: dict[TokenRole, list[torch.Tensor]] = {role: [] for role in ROLES}
    shifts = []
    for index, positions in enumerate(reference.positions):
        logits = answer_logits(model, dataset[index])[answered(positions)]
        kl = torch.nn.functional.kl_div(
            logits.log_softmax(-1), reference.log_probs[index], log_target=True, reduction="none"
        ).sum(-1)
        start = 0
        for role in ROLES:
            kl_by_role[role].append(kl[start : start + len(positions[role])])
            start += len(positions[role])
        shifts.append(logits.mean(-1) - reference.mean_logits[index])
    by_role = {role: torch.cat(values) for role, values in kl_by_role.items()}
    every = torch.cat(list(by_role.values()))
    shift = torch.cat(shifts)
    return SetDamage(
        rows=len(dataset),
        by_role={role.name.lower(): role_damage(values) for role, values in by_role.items()},
        all_tokens=role_damage(every),
        mean_logit_shift=shift.mean().item(),
        mean_absolute_logit_shift=shift.abs().mean().item(),
    )


def role_damage(kl: torch.Tensor) -> RoleDamage:
    return RoleDamage(kl.mean().item() if len(kl) else None, len(kl))


def measure(
    models: dict[str, Path], reference_dir: Path, data_dir: Path, rows: int, model_config: str
) -> dict[str, dict[str, SetDamage]]:
    """label -> set -> `SetDamage` for every model of `models` against `reference_dir`."""
    template_args = yaml.safe_load((CONFIG_DIR / "model" / f"{model_config}.yaml").read_text())[
        "template_args"
    ]
    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, torch_dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as spans_dir:
        datasets = {
            name: annotated_dataset(data_dir, name, rows, tokenizer, template_args, Path(spans_dir))
            for name in UTILITY_SETS
        }
        answers = {name: reference_answers(reference, dataset) for name, dataset in datasets.items()}
        del reference
        damage = {}
        for label, model_dir in models.items():
            model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
            damage[label] = {
                name: set_damage(model, answers[name], dataset) for name, dataset in datasets.items()
            }
    return damage


def table(damage: dict[str, dict[str, SetDamage]]) -> str:
    """Markdown: a row per model and set, KL per role (tokens) and the mean-logit shift."""
    headers = ["model", "set", *(f"KL {role.name.lower()}" for role in ROLES), "KL all", "mean-logit shift"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for label, sets in damage.items():
        for name, figures in sets.items():
            cells = [
                f"{part.mean_kl:.3g} ({part.tokens})" if part.mean_kl is not None else f"— ({part.tokens})"
                for part in (*(figures.by_role[role.name.lower()] for role in ROLES), figures.all_tokens)
            ]
            shift = f"{figures.mean_logit_shift:+.3g} (abs {figures.mean_absolute_logit_shift:.3g})"
            lines.append("| " + " | ".join([label, name.removesuffix("_perturbed"), *cells, shift]) + " |")
    return "\n".join(lines)


def converged_checkpoints(
    names: list[str], tofu_dir: Path, results: Path, jobs: int
) -> tuple[Path, Path, dict[str, Path]]:
    """Original, the experiment's data folder, and "<run> epoch <e>" -> checkpoint for every evaluated epoch
    of the named runs, each run made again in its own stage (see the module's docstring)."""
    parser = argparse.ArgumentParser()
    miniature.add_arguments(parser)
    parser.set_defaults(model="smollm2", data="tofu")
    options = ["--tofu-dir", str(tofu_dir), "--results", str(results), "--jobs", str(jobs)]
    args = miniature.parse_arguments(parser, options, "converged")
    args.size = "smollm2-converged"
    size = miniature.TOFU_SIZES[args.size]
    runs = {run.name: run for run in converged.tuning_runs(converged.CONVERGED_ROWS, size)}
    unknown = [name for name in names if name not in runs]
    if unknown:
        raise SystemExit(
            f"--converged-runs: not runs of the converged experiment: {', '.join(unknown)} (see --plan)"
        )
    progress = miniature.start_run("tofu", "tofu", args.size, args.run_dir, len(names))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        mini = miniature.tofu_miniature(args, progress, pool)
        made = {
            name: pool.submit(
                mini.stages.unlearn_cached,
                runs[name].method,
                runs[name].learning_rate,
                mini.original_dir,
                converged.run_overrides(runs[name]),
                f"{name}-damage",
            )
            for name in names
        }
        out_dirs = {name: job.result()[0] for name, job in made.items()}
    epochs = converged.evaluated_epochs(size.unlearn_epochs)
    checkpoints = {}
    for name, out_dir in out_dirs.items():
        by_epoch = miniature.whole_epoch_checkpoints(out_dir)
        checkpoints.update({f"{name} epoch {epoch}": by_epoch[epoch] for epoch in epochs})
        checkpoints[f"{name} epoch {size.unlearn_epochs}"] = out_dir
    return mini.original_dir, mini.stages.data_dir(), checkpoints


def labelled_path(text: str) -> tuple[str, Path]:
    label, separator, path = text.partition("=")
    if not separator or not label or not path:
        raise argparse.ArgumentTypeError(f"--model {text!r}: expected LABEL=DIR")
    return label, Path(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m palu_lab.damage", description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, help="the model before unlearning")
    parser.add_argument(
        "--checkpoint", type=labelled_path, action="append", help="LABEL=DIR, once per model measured"
    )
    parser.add_argument("--data-dir", type=Path, help=f"a TOFU folder holding {', '.join(UTILITY_SETS)}")
    parser.add_argument("--converged-runs", nargs="+", help="runs of the converged experiment, by name")
    parser.add_argument("--tofu-dir", type=Path, help="with --converged-runs: TOFU, as for converged.py")
    parser.add_argument("--results", type=Path, default=PROJECT_ROOT / "results")
    parser.add_argument("--jobs", type=int, default=1, help="with --converged-runs: runs at a time")
    parser.add_argument(
        "--rows", type=int, default=40, help="the first rows of each set (model utility's 40)"
    )
    parser.add_argument(
        "--model-config", default="SmolLM2-135M-Instruct",
        help="the plugin's model config (configs/model/NAME.yaml) whose template_args tokenise the rows",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.converged_runs and args.tofu_dir:
        reference, data_dir, models = converged_checkpoints(
            args.converged_runs, args.tofu_dir, args.results, args.jobs
        )
    elif args.reference and args.checkpoint and args.data_dir:
        reference, data_dir, models = args.reference, args.data_dir, dict(args.checkpoint)
    else:
        parser.error("give --converged-runs and --tofu-dir, or --reference, --checkpoint and --data-dir")
    damage = measure(models, reference, data_dir, args.rows, args.model_config)
    print(table(damage))
    if args.json:
        figures = {
            label: {name: asdict(part) for name, part in sets.items()} for label, sets in damage.items()
        }
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
