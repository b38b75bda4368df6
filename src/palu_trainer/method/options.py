"""PALU's and TPO's options (`trainer.method_args`), parsed by palu-train before the model loads and by the
trainers alike. configs/trainer/PALU.yaml, docs/method.md's table and palu-train's usage text are held to
these fields and defaults by tests/method/test_options.py."""

from palu_trainer.method.kl import KL_DIRECTIONS
from palu_trainer.method.local_loss import LOCAL_LOSS_SCALES, TARGETS, check_top_k
from palu_trainer.method.objective import PALUObjective, check_kl_weight
from palu_trainer.method.reference_cache import CACHE_DTYPES
from palu_trainer.validation import Alpha, Checked, Choice, Gamma, Integer, Number, Options

RETAIN_LOSS_TYPES = ("NLL", "KL", "none")
STOCK_RETAIN_LOSS_TYPES = ("NLL", "KL")  # what the framework's GradDiff computes
BOOLEAN = (True, False)


class PALUOptions(Options):
    """Every option of PALUTrainer with its default; each field's description is its help."""

    OWNER = "PALUTrainer"
    MOVED = {
        "num_initiating_tokens": "num_initiating_tokens (N) belongs to the forget dataset, which fixes token "
        "roles: set it with the experiment's top-level `num_initiating_tokens=N`, not trainer.method_args",
    }

    gamma: Gamma = 1.0
    alpha: Alpha = 1.0
    retain_loss_type: Choice("the retain loss: NLL, KL (as GradDiff) or none", *RETAIN_LOSS_TYPES) = "NLL"
    top_k: Checked(
        "K: a positive integer (capped at |V|), `all`, or a share of |V| in (0, 1]", check_top_k
    ) = 0.15625
    target: Choice("c of the local loss", *TARGETS) = "global_mean"
    target_gradient: Choice("true: gradient flows through c (the released code)", *BOOLEAN) = False
    kl_direction: Choice("ref_to_policy: KL(P_ref ‖ P_θ) (the paper); policy_to_ref", *KL_DIRECTIONS) = (
        "ref_to_policy"
    )
    kl_weight: Checked("λ >= 0, or `alpha` (the released code's loss)", check_kl_weight) = 1.0
    merge_adjacent_spans: Choice("must match the forget dataset's initiating policy", *BOOLEAN) = False
    reference_cache: Choice(
        "auto | true | false: the reference's targets cached per forget row, no reference model",
        "auto",
        *BOOLEAN,
    ) = "auto"
    reference_cache_top_m: Integer("m: P_ref's entries kept per common position", ge=1) = 512
    reference_cache_dtype: Choice("the cache's precision", *CACHE_DTYPES) = "float32"
    reference_cache_max_gib: Number(
        "with auto: host GiB per rank above which the reference model is kept instead", ge=0
    ) = 4.0
    local_loss_scale: Choice(
        "none (the paper) | reference: the local loss over the reference's own", *LOCAL_LOSS_SCALES
    ) = "none"
    log_term_gradient_norms: Choice(
        "true: log each weighted term's gradient norm (not under DeepSpeed)", *BOOLEAN
    ) = False

    def objective(self, top_k: int, chunk_rows: int | None = None) -> PALUObjective:
        """The objective these options ask for, with K resolved (see `PALUObjective`)."""
        shared = "target target_gradient kl_direction kl_weight local_loss_scale gamma alpha".split()
        return PALUObjective(top_k, chunk_rows=chunk_rows, **{name: getattr(self, name) for name in shared})


class TPOOptions(Options):
    """TPOTrainer's options: β of the logit preference loss and GradDiff's weights and retain loss."""

    OWNER = "TPOTrainer"

    beta: Number(
        "TPO's logit-preference temperature; 0 divides by zero, a negative one rewards the sensitive tokens",
        gt=0,
    ) = 0.32
    gamma: Gamma = 1.0
    alpha: Alpha = 1.0
    retain_loss_type: Choice("the retain loss, as GradDiff", *STOCK_RETAIN_LOSS_TYPES) = "NLL"
