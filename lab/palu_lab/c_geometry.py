"""The local loss's gradient at the final hidden state, with c detached and with c carrying its gradient
(issue 59): `python -m palu_lab.c_geometry --model DIR --tofu-dir DIR --spans FILE`.

No training. The reference is the model itself (step 0: the top-K are its own). At each initiating position
p of the first `--rows` forget rows, with h_p the final hidden state and W the output layer (|V|, d),
z = W h_p, the per-position local loss ℓ = (1/K)·Σ_{i∈top-K}(z_i − c)², c = mean_j z_j:

- detached: ∇_h ℓ = Wᵀ g with g_i = (2/K)(z_i − c) on the top-K, 0 elsewhere;
- through c: the same g minus its mean over V, so ∇_h ℓ differs by −(2/K)·Σ_{top-K}(z_i − c) · w̄, w̄ the
  mean output row. With c detached, the gradient on the logits does not sum to zero: part of the step moves
  every logit together, which leaves the softmax unchanged.

Printed per model: the median [min–max] over positions of both gradients' norms, their cosine, the norm of
their difference and its cosine with w̄; the mean cosine of the output rows with w̄; with `--json`, the same
as a file.
"""

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from palu_trainer.framework.checkout import CONFIG_DIR
from palu_trainer.framework.datasets import QAwithSpansDataset
from palu_trainer.method.local_loss import local_entropy_loss, resolve_top_k
from palu_trainer.method.roles import at_forget_positions

TOP_K = 0.15625  # configs/trainer/PALU.yaml's share of |V| (the paper's 5000 of 32000)


@dataclass(frozen=True)
class Summary:
    """median, min, max over the initiating positions."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> "Summary":
        return cls(statistics.median(values), min(values), max(values))

    def __str__(self) -> str:
        return f"{self.median:.3g} [{self.low:.3g}–{self.high:.3g}]"


@dataclass(frozen=True)
class Geometry:
    model: str
    vocab_size: int
    top_k: int
    rows: int
    positions: int
    detached_norm: Summary
    through_c_norm: Summary
    cosine: Summary
    difference_norm: Summary
    difference_cosine_with_mean_row: Summary
    logit_gradient_sum_detached: Summary
    logit_gradient_sum_through_c: Summary
    output_rows_cosine_with_mean_row: float
    tied_embeddings: bool


def hidden_state_gradients(
    hidden: torch.Tensor, output_rows: torch.Tensor, top_k: int, target_gradient: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, ∇_h and ∇_z of its local loss (method.local_loss, c = global mean).

    Args:
        hidden: (M, d) final hidden states at initiating positions.
        output_rows: (V, d) the output layer.

    Returns:
        (M, d) hidden-state gradients and (M, V) logit gradients.
    """
    hidden = hidden.detach().double().requires_grad_(True)
    logits = hidden @ output_rows.double().T
    logits.retain_grad()
    topk = logits.detach().topk(top_k, dim=-1).indices  # the reference is the model (step 0)
    # the sum of the per-position losses: each position's gradient is its own loss's
    loss = local_entropy_loss(logits, topk, "global_mean", target_gradient=target_gradient) * len(hidden)
    loss.backward()
    return hidden.grad, logits.grad


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def measure(model_dir: Path, dataset: QAwithSpansDataset, rows: int, top_k=TOP_K) -> Geometry:
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    output_rows = model.get_output_embeddings().weight.detach()
    k = resolve_top_k(top_k, output_rows.shape[0])
    hidden = []
    with torch.no_grad():
        for item in (dataset[index] for index in range(rows)):
            outputs = model(
                input_ids=item["input_ids"][None], attention_mask=item["attention_mask"][None],
                output_hidden_states=True,
            )  # fmt: skip
            # Llama's last hidden state is after the final norm: the lm_head's input
            initiating, _ = at_forget_positions(outputs.hidden_states[-1], item["token_roles"][None])
            hidden.append(initiating)
    hidden = torch.cat(hidden)
    detached, logits_detached = hidden_state_gradients(hidden, output_rows, k, target_gradient=False)
    through_c, logits_through_c = hidden_state_gradients(hidden, output_rows, k, target_gradient=True)
    mean_row = output_rows.double().mean(0)
    difference = detached - through_c
    values = {
        "detached_norm": detached.norm(dim=-1),
        "through_c_norm": through_c.norm(dim=-1),
        "cosine": cosine(detached, through_c),
        "difference_norm": difference.norm(dim=-1),
        "difference_cosine_with_mean_row": cosine(difference, mean_row[None]),
        "logit_gradient_sum_detached": logits_detached.sum(-1),
        "logit_gradient_sum_through_c": logits_through_c.sum(-1),
    }
    input_rows = model.get_input_embeddings().weight
    return Geometry(
        model=str(model_dir),
        vocab_size=output_rows.shape[0],
        top_k=k,
        rows=rows,
        positions=len(hidden),
        **{name: Summary.of(value.tolist()) for name, value in values.items()},
        output_rows_cosine_with_mean_row=cosine(output_rows.double(), mean_row[None]).mean().item(),
        tied_embeddings=input_rows.data_ptr() == output_rows.data_ptr(),
    )


def forget_dataset(model_dir: Path, template_args: dict, tofu_dir: Path, split: str, spans: Path):
    return QAwithSpansDataset(
        span_annotations=spans,
        hf_args={"path": str(tofu_dir), "name": split, "split": "train"},
        template_args=template_args,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
    )


def lines(geometry: Geometry) -> list[str]:
    return [
        f"{geometry.model}: |V| {geometry.vocab_size}, K {geometry.top_k}, {geometry.positions} initiating "
        f"positions in {geometry.rows} rows, tied embeddings: {geometry.tied_embeddings}",
        f"  ‖∇h‖ c detached: {geometry.detached_norm}; c with gradient: {geometry.through_c_norm}",
        f"  cosine between them: {geometry.cosine}",
        f"  their difference: norm {geometry.difference_norm}, cosine with the mean output row "
        f"{geometry.difference_cosine_with_mean_row}",
        f"  Σ_V ∂ℓ/∂z: c detached {geometry.logit_gradient_sum_detached}; c with gradient "
        f"{geometry.logit_gradient_sum_through_c}",
        f"  mean cosine of the output rows with their mean: {geometry.output_rows_cosine_with_mean_row:.3f}",
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m palu_lab.c_geometry", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face model folder")
    parser.add_argument(
        "--model-config", default="SmolLM2-135M-Instruct",
        help="the plugin's model config (configs/model/NAME.yaml) whose template_args tokenise the rows",
    )  # fmt: skip
    parser.add_argument("--tofu-dir", type=Path, required=True)
    parser.add_argument("--split", default="forget05")
    parser.add_argument("--spans", type=Path, help="span file (default: the plugin's for --split)")
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--top-k", type=float, default=TOP_K, help="a share of |V| as in PALU.yaml")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    config = yaml.safe_load((CONFIG_DIR / "model" / f"{args.model_config}.yaml").read_text())
    spans = args.spans or CONFIG_DIR.parent / "span_annotations" / f"tofu_{args.split}.jsonl"
    dataset = forget_dataset(args.model, config["template_args"], args.tofu_dir, args.split, spans)
    geometry = measure(args.model, dataset, min(args.rows, len(dataset)), args.top_k)
    print("\n".join(lines(geometry)))
    if args.json:
        args.json.write_text(json.dumps(asdict(geometry), indent=2))


if __name__ == "__main__":
    main()
