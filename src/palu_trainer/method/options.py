"""PALU's options (`trainer.method_args`): one typed object, checked once, before the model loads.

palu-train checks the composed config's method_args with `PALUOptions.from_method_args` before loading
anything, and `PALUTrainer` builds its options the same way. configs/trainer/PALU.yaml, docs/method.md's
table and palu-train's usage text are held to these fields and defaults by tests/method/test_options.py.
"""

import difflib
from dataclasses import MISSING, dataclass, field, fields

from palu_trainer.method.checks import LOSS_WEIGHTS, check_choice, check_number
from palu_trainer.method.kl import check_kl_direction
from palu_trainer.method.local_loss import check_local_loss_scale, check_target, check_top_k
from palu_trainer.method.objective import PALUObjective, check_kl_weight
from palu_trainer.method.reference_cache import cache_dtype, check_top_m

RETAIN_LOSS_TYPES = ("NLL", "KL", "none")


def option(default, check, help: str):
    return field(default=default, metadata={"check": check, "help": help})


def boolean(name):
    return lambda value: check_choice(name, value, (True, False))


@dataclass(frozen=True)
class PALUOptions:
    """Every option of PALUTrainer, with its default and its check; `help` is in each field's metadata."""

    gamma: float = option(
        1.0, lambda v: check_number("gamma", v, LOSS_WEIGHTS["gamma"]), "weight of the forget terms"
    )
    alpha: float = option(
        1.0, lambda v: check_number("alpha", v, LOSS_WEIGHTS["alpha"]), "weight of the retain loss"
    )
    retain_loss_type: str = option(
        "NLL",
        lambda v: check_choice("retain_loss_type", v, RETAIN_LOSS_TYPES),
        "NLL, KL (as GradDiff) or none",
    )
    top_k: int | float | str = option(
        0.15625, check_top_k, "K: a positive integer (capped at |V|), `all`, or a share of |V| in (0, 1]"
    )
    target: str = option("global_mean", check_target, "c of the local loss")
    target_gradient: bool = option(
        False, boolean("target_gradient"), "true: gradient flows through c (the released code)"
    )
    kl_direction: str = option(
        "ref_to_policy", check_kl_direction, "ref_to_policy: KL(P_ref ‖ P_θ) (the paper); policy_to_ref"
    )
    kl_weight: float | str = option(1.0, check_kl_weight, "λ >= 0, or `alpha` (the released code's loss)")
    merge_adjacent_spans: bool = option(
        False, boolean("merge_adjacent_spans"), "must match the forget dataset's initiating policy"
    )
    reference_cache: bool | str = option(
        "auto",
        lambda v: check_choice("reference_cache", v, ("auto", True, False)),
        "auto | true | false: the reference's targets cached per forget row, no reference model",
    )
    reference_cache_top_m: int = option(512, check_top_m, "m: P_ref's entries kept per common position")
    reference_cache_dtype: str = option("float32", cache_dtype, "float32 | float16 | bfloat16")
    reference_cache_max_gib: float = option(
        4.0,
        lambda v: check_number(
            "reference_cache_max_gib", v, "host GiB per rank that reference_cache=auto may use"
        ),
        "with auto: host GiB per rank above which the reference model is kept instead",
    )
    local_loss_scale: str = option(
        "none",
        check_local_loss_scale,
        "none (the paper) | reference: the local loss over the reference's own",
    )
    log_term_gradient_norms: bool = option(
        False,
        boolean("log_term_gradient_norms"),
        "true: log each weighted term's gradient norm (not under DeepSpeed)",
    )

    # method_args that moved elsewhere: the message says where.
    MOVED = {
        "num_initiating_tokens": "num_initiating_tokens (N) belongs to the forget dataset, which fixes token "
        "roles: set it with the experiment's top-level `num_initiating_tokens=N`, not trainer.method_args",
    }

    def __post_init__(self):
        for each in fields(self):
            each.metadata["check"](getattr(self, each.name))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(each.name for each in fields(cls))

    @classmethod
    def defaults(cls) -> dict:
        return {each.name: each.default for each in fields(cls) if each.default is not MISSING}

    @classmethod
    def from_method_args(cls, method_args: dict) -> "PALUOptions":
        """The options of `method_args` (every key an option; absent ones take their defaults), or a
        ValueError naming the first bad key or value and what to write instead."""
        for key in method_args:
            if key in cls.MOVED:
                raise ValueError(cls.MOVED[key])
            if key not in cls.names():
                close = difflib.get_close_matches(key, cls.names(), n=1)
                suggestion = f"did you mean {close[0]}? " if close else ""
                raise ValueError(
                    f"{key} is not an option of PALUTrainer: {suggestion}its options are "
                    f"{', '.join(sorted(cls.names()))}"
                )
        return cls(**method_args)

    def objective(self, top_k: int, chunk_rows: int | None = None) -> PALUObjective:
        """The objective these options ask for, with K resolved against the model's vocabulary
        (`local_loss.resolve_top_k`) and `chunk_rows` positions projected at once."""
        return PALUObjective(
            top_k=top_k,
            target=self.target,
            target_gradient=self.target_gradient,
            kl_direction=self.kl_direction,
            kl_weight=self.kl_weight,
            local_loss_scale=self.local_loss_scale,
            gamma=self.gamma,
            alpha=self.alpha,
            chunk_rows=chunk_rows,
        )
