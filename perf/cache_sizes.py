"""Reference-cache bytes before and after, for TOFU forget10 and MUSE-News at their models' vocabularies.

Positions are estimated without a tokenizer (none ships offline): tokens = characters / CHARS_PER_TOKEN,
the usual ~4 characters per token of Llama BPE vocabularies on English prose. TOFU forget10 uses the shipped
span annotations (answer tokens outside spans and the EOS are common; the first N=3 tokens of a span
initiate it); the MUSE-News forget set has no spans, so every token of its raw text is common (worst case).
Forms: `full` is the cache before this change (P_ref over |V| in fp32 per common position); `hidden` keeps
the reference's final hidden state (d fp32) per common position plus a bf16 copy of the step-0 output
projection (|V| x d); `top-m` (kept) keeps m entries and a tail bucket (`estimated_nbytes`, for
KL(P_ref || P_theta); KL(P_theta || P_ref) needs 4 bytes less per common position).
"""

import argparse
import json
from pathlib import Path

import torch

from palu_trainer.method.local_loss import resolve_top_k
from palu_trainer.method.reference_cache import estimated_nbytes

CHARS_PER_TOKEN = 4.0
ROOT = Path(__file__).resolve().parents[1]
# (benchmark, model, |V|, hidden size d)
MODELS = [
    ("TOFU forget10", "Llama-3.2-1B", 128256, 2048),
    ("TOFU forget10", "Llama-3.1-8B", 128256, 4096),
    ("MUSE-News forget", "Llama-2-7B", 32000, 4096),
]


def tofu_positions(annotations: Path, tofu: Path, num_initiating: int = 3) -> tuple[int, int]:
    answers = [json.loads(line)["answer"] for line in tofu.read_text().splitlines() if line.strip()]
    initiating = common = 0
    for line in annotations.read_text().splitlines():
        row = json.loads(line)
        span_tokens = [max(1, round((end - start) / CHARS_PER_TOKEN)) for start, end in row["spans"]]
        answer_tokens = round(len(answers[row["index"]]) / CHARS_PER_TOKEN) + 1  # + EOS
        initiating += sum(min(num_initiating, n) for n in span_tokens)
        common += max(0, answer_tokens - sum(span_tokens))
    return initiating, common


def muse_positions(forget: Path) -> tuple[int, int]:
    characters = sum(
        len(json.loads(line)["text"]) for line in forget.read_text().splitlines() if line.strip()
    )
    return 0, round(characters / CHARS_PER_TOKEN)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("/work/shared/data"))
    parser.add_argument(
        "--top-k", type=float, default=0.15625, help="K as a share of |V| (the default: PALU.yaml's)"
    )
    parser.add_argument("--top-m", type=int, default=512)
    args = parser.parse_args(argv)
    positions = {
        "TOFU forget10": tofu_positions(
            ROOT / "span_annotations" / "tofu_forget10.jsonl", args.data / "tofu" / "forget10.json"
        ),
        "MUSE-News forget": muse_positions(args.data / "muse_news" / "raw" / "forget.jsonl"),
    }
    columns = ["forget set", "model (V, d)", "K", "initiating", "common", "full (GiB)", "hidden + W0 (GiB)"]
    columns += [f"top-m={args.top_m} (GiB)", "top-m / full", "bytes per common position: full -> top-m"]
    print("| " + " | ".join(columns) + " |\n" + "| --- " * len(columns) + "|")
    for benchmark, model, vocab, hidden in MODELS:
        initiating, common = positions[benchmark]
        top_k = resolve_top_k(args.top_k, vocab)
        initiating_bytes = initiating * (top_k * 4 + 4)
        full = initiating_bytes + common * (vocab * 4 + 4)
        hidden_form = initiating_bytes + common * hidden * 4 + vocab * hidden * 2
        top_m = estimated_nbytes(initiating, common, top_k, args.top_m, torch.float32)
        per_position = estimated_nbytes(0, 1, top_k, args.top_m, torch.float32)
        cells = [benchmark, f"{model} ({vocab}, {hidden})", str(top_k), str(initiating), str(common)]
        cells += [f"{b / 2**30:.2f}" for b in (full, hidden_form, top_m)]
        cells += [f"1/{full / top_m:.0f}", f"{vocab * 4 + 4} -> {per_position}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
