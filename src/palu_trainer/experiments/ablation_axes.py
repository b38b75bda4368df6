"""The paper's PALU ablation axes (its Figure 4 and strategy tables): one table that the CPU ablation on the
miniature (`ablation.py`) and the GPU recipe (`recipe.py --ablation`) both run."""

from dataclasses import dataclass

ABLATED_METHOD = "PALU"


@dataclass(frozen=True)
class Axis:
    title: str
    points: dict[str, tuple[str, ...]]  # label -> overrides; () is PALU's defaults
    default: str  # the default point's label


def top_k(value: str) -> tuple[str, ...]:
    return (f"trainer.method_args.top_k={value}",)


def initiating(strategy: str, **values) -> tuple[str, ...]:
    return (f"initiating_strategy={strategy}", *(f"{key}={value}" for key, value in values.items()))


# THE table of the paper's axes. K: shares of |V| matching the paper's values on Llama-2 (1, 1000, 5000,
# 10000 of 32000); N and the strategy belong to the forget dataset (the experiment's top-level keys).
AXES = {
    "k": Axis(
        "K: the reference's top-K logits flattened (share of |V|, as the paper's values on Llama-2)",
        {
            "1": top_k("1"),
            "1k/32k": top_k("0.03125"),
            "5k/32k": (),
            "10k/32k": top_k("0.3125"),
            "all": top_k("all"),
        },
        default="5k/32k",
    ),
    "n": Axis(
        "N: initiating tokens per span",
        {
            "1": ("num_initiating_tokens=1",),
            "2": ("num_initiating_tokens=2",),
            "3": (),
            "4": ("num_initiating_tokens=4",),
            "All": initiating("all"),
        },
        default="3",
    ),
    "c": Axis(
        "c: the target of the local entropy loss",
        {
            "uniform": ("trainer.method_args.target=uniform",),
            "topk_mean": ("trainer.method_args.target=topk_mean",),
            "ref_mean": ("trainer.method_args.target=ref_mean",),
            "global_mean": (),
        },
        default="global_mean",
    ),
    "strategy": Axis(
        "strategy: which tokens of each span initiate",
        {
            "first 3": (),
            "random 3": initiating("random_n", num_initiating_tokens=3),
            "all tokens": initiating("all"),
            "first 25%": initiating("ratio", initiating_ratio=0.25),
            "first 50%": initiating("ratio", initiating_ratio=0.5),
            "first 100%": initiating("ratio", initiating_ratio=1.0),
        },
        default="first 3",
    ),
}
