"""Step time and memory of every side-by-side method (palu_trainer.experiments.methods) on one model.

Run with `make bench`. Each method runs with its trainer config's stock `method_args` (plus its bench
variants: PALU with the reference model and with the reference cache), on the same batches. Also
times PALU's loss alone against K on a 128k vocabulary. Prints a table and
ratios and writes JSON (default results/bench.json).

Memory: on CUDA, torch.cuda.max_memory_allocated over the timed steps. On CPU, the bytes of what a method
keeps on the accelerator between steps: parameters, gradients, optimizer state and the reference model's
parameters (activations excluded: freed between steps and about equal across methods). PALU's reference
cache lives in host memory by design (it is on the host on GPUs too); its size is reported separately.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from palu_trainer.experiments.methods import METHODS
from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.framework.plugin import register, trainer_config
from palu_trainer.method.losses import ReferenceTargets, palu_forget_loss
from palu_trainer.method.roles import TokenRole

ensure_importable()
from data.collators import DataCollatorForSupervisedDataset  # noqa: E402
from data.unlearn import ForgetRetainDataset  # noqa: E402
from trainer import TRAINER_REGISTRY  # noqa: E402

from palu_trainer.framework.datasets import DataCollatorWithTokenRoles  # noqa: E402

BASELINES = ("GradDiff", "NPO")  # the ratios' denominators


def bench_runs(top_k: int) -> dict[str, tuple[str, dict, bool]]:
    """Bench label -> (trainer handler, method_args, needs token roles), from the method table."""
    runs = {}
    for name, method in METHODS.items():
        config = OmegaConf.to_container(
            trainer_config(method.trainer, method.trainer_overrides), resolve=True
        )
        method_args = config.get("method_args", {})
        if "top_k" in method_args:
            method_args["top_k"] = top_k
        for variant, extra in method.bench_variants.items():
            label = f"{name}, {variant}" if variant else name
            runs[label] = (config["handler"], {**method_args, **extra}, method.uses_spans)
    return runs


class PadToken:
    """The collator needs only the pad id from a tokenizer."""

    pad_token_id = 0


def make_rows(count, length, vocab_size, seed, with_roles):
    """QA-shaped rows: a 12-token prompt, then an answer with a 5-token span every 16 tokens (N=3)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(count):
        input_ids = torch.randint(3, vocab_size, (length,), generator=generator)
        labels = input_ids.clone()
        labels[:12] = -100
        row = {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": torch.ones(length, dtype=torch.long),
        }
        row["index"] = index
        if with_roles:
            roles = torch.full((length,), int(TokenRole.COMMON))
            roles[:12] = TokenRole.IGNORED
            for start in range(16, length - 5, 16):
                roles[start : start + 3] = TokenRole.INITIATING
                roles[start + 3 : start + 5] = TokenRole.REDUNDANT
            row["token_roles"] = roles
        rows.append(row)
    return rows


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def accelerator_state_bytes(trainer):
    model_bytes = tensor_bytes(trainer.model.parameters())
    grad_bytes = tensor_bytes(p.grad for p in trainer.model.parameters())
    optimizer_bytes = tensor_bytes(v for state in trainer.optimizer.state.values() for v in state.values())
    reference = getattr(trainer, "ref_model", None)
    reference_bytes = tensor_bytes(reference.parameters()) if reference is not None else 0
    return model_bytes + grad_bytes + optimizer_bytes + reference_bytes


def bench_method(run, config, args, device, batches, forget, retain):
    """`batches`: with roles and row indices (span methods) and without (the others), same rows."""
    handler, method_args, uses_spans = run
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    trainer_cls = TRAINER_REGISTRY[handler]
    training_args = TrainingArguments(
        output_dir=str(Path(args.out).parent / "bench-trainer"),
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-5,
        report_to=[],
        use_cpu=device == "cpu",
        remove_unused_columns=False,
    )
    trainer = trainer_cls(
        model=model,
        args=training_args,
        train_dataset=ForgetRetainDataset(forget=forget, retain=retain),
        tokenizer=None,
        data_collator=DataCollatorWithTokenRoles(PadToken()),
        **method_args,
    )
    trainer.create_optimizer()
    times = []
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for step, batch in enumerate(batches[uses_spans]):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.training_step(trainer.model, batch)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=False)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    memory = torch.cuda.max_memory_allocated() if device == "cuda" else accelerator_state_bytes(trainer)
    cache = getattr(trainer, "reference_cache", None)
    result = {
        "step_s": statistics.median(times),
        "memory_bytes": memory,
        "host_cache_bytes": cache.nbytes if cache is not None else 0,
        "steps_timed": len(times),
    }
    del trainer, model
    return result


def bench_top_k(device, vocab_size=128256, batch=2, length=128, repeats=5):
    """Forward+backward time of PALU's forget loss alone, against K, given the reference targets."""
    torch.manual_seed(0)
    logits = torch.randn(batch, length, vocab_size, device=device, requires_grad=True)
    roles = torch.full((batch, length), int(TokenRole.COMMON), device=device)
    roles[:, ::10] = TokenRole.INITIATING
    roles[:, 1::10] = TokenRole.REDUNDANT
    initiating = int((roles[:, 1:] == TokenRole.INITIATING).sum())  # token t is predicted at t-1
    common_probs = torch.softmax(torch.randn(int((roles[:, 1:] == TokenRole.COMMON).sum()), vocab_size), -1)
    common_neg_entropy = torch.special.xlogy(common_probs, common_probs).sum(-1)
    results = {}
    for top_k in (1, 1000, 5000, 10000, vocab_size):
        reference = ReferenceTargets(
            topk_indices=torch.randint(0, vocab_size, (initiating, top_k), device=device),
            logit_mean=torch.zeros(initiating, device=device),
            common_probs=common_probs.to(device),
            common_neg_entropy=common_neg_entropy.to(device),
        )
        durations = []
        for _ in range(repeats + 1):
            logits.grad = None
            start = time.perf_counter()
            local, kl = palu_forget_loss(logits, roles, reference)
            local.backward(retain_graph=True)
            local_done = time.perf_counter()
            kl.backward()
            if device == "cuda":
                torch.cuda.synchronize()
            durations.append((local_done - start, time.perf_counter() - start))
        local_s = statistics.median(d[0] for d in durations[1:])
        total_s = statistics.median(d[1] for d in durations[1:])
        results[str(top_k)] = {"local_ms": 1000 * local_s, "local_plus_kl_ms": 1000 * total_s}
    return {
        "vocab_size": vocab_size,
        "batch": batch,
        "length": length,
        "initiating": initiating,
        "by_k": results,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bench.json")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=5000)
    parser.add_argument("--no-k-sweep", action="store_true", help="skip the loss-alone K sweep")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(torch.get_num_threads())

    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    forget = make_rows(args.batch_size * args.steps, args.length, args.vocab_size, seed=1, with_roles=True)
    retain = make_rows(args.batch_size * args.steps, args.length, args.vocab_size, seed=2, with_roles=False)

    def collate(collator):
        steps = [range(step * args.batch_size, (step + 1) * args.batch_size) for step in range(args.steps)]
        batches = [collator([{"forget": forget[i], "retain": retain[i]} for i in rows]) for rows in steps]
        return [{k: {n: t.to(device) for n, t in v.items()} for k, v in batch.items()} for batch in batches]

    batches = (
        collate(DataCollatorForSupervisedDataset(PadToken())),
        collate(DataCollatorWithTokenRoles(PadToken())),
    )
    parameters = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    print(
        f"device={device} threads={torch.get_num_threads()} model={parameters / 1e6:.1f}M parameters "
        f"(V={args.vocab_size}, hidden={args.hidden_size}, layers={args.layers}), batch={args.batch_size}x"
        f"{args.length} tokens, {args.steps - args.warmup} timed steps after {args.warmup} warm-up, "
        f"K={args.top_k}"
    )
    register()
    methods = {}
    for name, run in bench_runs(args.top_k).items():
        started = time.perf_counter()
        methods[name] = bench_method(run, config, args, device, batches, forget, retain)
        print(f"  {name}: done in {time.perf_counter() - started:.1f} s", flush=True)
    top_k = None if args.no_k_sweep else bench_top_k(device)

    memory_kind = (
        "cuda max_memory_allocated" if device == "cuda" else "params+grads+optimizer+reference model"
    )
    columns = ["method", "step (s)", "vs GradDiff", "vs NPO", f"memory (MiB, {memory_kind})", "vs GradDiff"]
    columns += ["vs NPO", "host cache (MiB)"]
    print("\n| " + " | ".join(columns) + " |\n" + "| --- " * len(columns) + "|")
    for name, result in methods.items():
        for base in BASELINES:
            result[f"step_vs_{base}"] = result["step_s"] / methods[base]["step_s"]
            result[f"memory_vs_{base}"] = result["memory_bytes"] / methods[base]["memory_bytes"]
        print(
            f"| {name} | {result['step_s']:.3f} | {result['step_vs_GradDiff']:.2f} "
            f"| {result['step_vs_NPO']:.2f} "
            f"| {result['memory_bytes'] / 2**20:.0f} | {result['memory_vs_GradDiff']:.2f} "
            f"| {result['memory_vs_NPO']:.2f} | {result['host_cache_bytes'] / 2**20:.0f} |"
        )
    if top_k:
        print(
            f"\nPALU loss alone (forward+backward), V={top_k['vocab_size']}, "
            f"{top_k['initiating']} initiating positions:"
        )
        print("| K | local (ms) | local + KL (ms) |\n| --- | --- | --- |")
        for k, timing in top_k["by_k"].items():
            print(f"| {k} | {timing['local_ms']:.1f} | {timing['local_plus_kl_ms']:.1f} |")
    targets = {}
    if "PALU, reference cache" in methods:
        cached = methods["PALU, reference cache"]
        targets = {
            "PALU cached step <= 1.05x GradDiff": cached["step_vs_GradDiff"] <= 1.05,
            "PALU cached step <= 0.90x NPO": cached["step_vs_NPO"] <= 0.90,
            "PALU cached memory <= 0.85x NPO": cached["memory_vs_NPO"] <= 0.85,
        }
    print("\n" + "\n".join(f"{'met ' if ok else 'MISSED'} {target}" for target, ok in targets.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": device,
        "threads": torch.get_num_threads(),
        "parameters": parameters,
        "memory_measure": memory_kind,
        "args": vars(args),
        "methods": methods,
        "top_k_loss": top_k,
        "targets": targets,
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
