"""PALU's and TPO's options (`trainer.method_args`), parsed by palu-train before the model loads and by the
trainers alike. Each field holds its type, default, range, a short meaning (for messages) and its help, from
which `make options-table` writes docs/method.md's table; tests/method/test_options.py checks the table, the
values of configs/trainer/PALU.yaml and palu-train's usage text against them."""

from palu_trainer.method.kl import KL_DIRECTIONS
from palu_trainer.method.local_loss import LOCAL_LOSS_SCALES, TARGETS, check_top_k
from palu_trainer.method.objective import PALUObjective, check_kl_weight
from palu_trainer.method.reference_cache import CACHE_DTYPES
from palu_trainer.validation import Alpha, Checked, Choice, Gamma, Integer, Number, Options

RETAIN_LOSS_TYPES = ("NLL", "KL", "none")
STOCK_RETAIN_LOSS_TYPES = ("NLL", "KL")  # what the framework's GradDiff computes
BOOLEAN = (True, False)


class PALUOptions(Options):
    """Every option of PALUTrainer: its type, default and range, its meaning and its help (the meaning where a
    field has no more to say)."""

    OWNER = "PALUTrainer"
    MOVED = {
        "num_initiating_tokens": "num_initiating_tokens (N) belongs to the forget dataset, which fixes token "
        "roles: set it with the experiment's top-level `num_initiating_tokens=N`, not trainer.method_args",
    }

    gamma: Gamma = 1.0
    alpha: Alpha = 1.0
    retain_loss_type: Choice("the retain loss: NLL, KL (as GradDiff) or none", *RETAIN_LOSS_TYPES) = "NLL"
    top_k: Checked(
        "K: a positive integer (capped at |V|), `all`, or a share of |V| in (0, 1]",
        check_top_k,
        help=(
            "K: top-K logits of the frozen reference model flattened at each initiating token. A positive "
            "integer (capped at |V|), `all` (|V|), or a float share of |V| in (0, 1]: K = round(p·|V|); |V| "
            "is the tokenizer's vocabulary when the model pads its own beyond it (a warning names both). The "
            "default is the paper's K=5000 as its share of Llama-2's 32000 tokens, so it means the same on "
            "every vocabulary: 5000 on Llama-2, 20040 on Llama-3 (128256); in the demo 260 of the synthetic "
            "tokenizer's 1665, 160 of FAST's 1024, 640 of `DATA=tofu`'s 4096. `1` is K=1, `1.0` is all. The "
            "resolved K is logged with |V| and its share; K = |V| (capped, `all` or `1.0`) warns that the "
            "local term is then full-vocabulary flattening (PDU-like), not the paper's top-K"
        ),
    ) = 0.15625
    target: Choice(
        "c of the local loss",
        *TARGETS,
        help=(
            "c: `global_mean` (the paper: mean of the current logits over V), `topk_mean` (their mean over "
            "the top-K), `ref_mean` (the reference's mean logit), `uniform` (logsumexp(z) − log|V|, see "
            "below), `zero` (c = 0)"
        ),
    ) = "global_mean"
    target_gradient: Choice(
        "true: gradient flows through c (the released code)",
        *BOOLEAN,
        help=(
            "`false` (the paper): c is a fixed target, only the K reference entries get gradient. `true` "
            "(the released code): gradient also flows through c into every logit"
        ),
    ) = False
    kl_direction: Choice(
        "ref_to_policy: KL(P_ref ‖ P_θ) (the paper); policy_to_ref",
        *KL_DIRECTIONS,
        help=(
            "`ref_to_policy`: KL(P_ref ‖ P_θ) on common tokens (the paper); `policy_to_ref`: KL(P_θ ‖ P_ref) "
            "(the released code)"
        ),
    ) = "ref_to_policy"
    kl_weight: Checked(
        "λ >= 0, or `alpha` (the released code's loss)",
        check_kl_weight,
        help=(
            "λ >= 0: loss = gamma·(local + λ·KL) + alpha·retain (paper grid 1, 2, 5, 10). `alpha`: loss = "
            "gamma·local + alpha·KL + alpha·retain, the released code's single alpha for the KL and the "
            "retain loss"
        ),
    ) = 1.0
    merge_adjacent_spans: Choice(
        "must match the forget dataset's initiating policy",
        *BOOLEAN,
        help=(
            "`true` (the released code): spans with no token between them (only whitespace the tokenizer "
            "attaches to the next word) are one span before the initiating tokens are chosen. Roles are "
            "fixed by the forget dataset: `experiment=unlearn/tofu/palu` passes this value to it and the "
            "trainer checks they agree"
        ),
    ) = False
    reference_cache: Choice(
        "auto | true | false: the reference's targets cached per forget row, no reference model",
        "auto",
        *BOOLEAN,
        help=(
            "before the first step the policy (still the reference) runs once over the forget set; the top-K "
            "indices and mean logits at initiating positions and, at common positions, the reference's m "
            "most probable entries with their P_ref (`ref_to_policy`) or log P_ref (`policy_to_ref`, exact "
            "where P_ref underflows) and the rest of its mass as one tail bucket stay in host memory, and no "
            "reference model is built. `auto`: on unless `retain_loss_type=KL` or the size estimated before "
            "building exceeds `reference_cache_max_gib` (then the reference model; the estimate and the "
            "choice are logged). `true`: always; `false`: the reference model is kept (sharded under ZeRO-3) "
            "and run every step. Resuming rebuilds the cache from the starting model "
            "([operations.md](operations.md#resuming)); the cache's host-memory budget: "
            "[operations.md](operations.md#reference-cache-budget)"
        ),
    ) = "auto"
    reference_cache_top_m: Integer(
        "m: P_ref's entries kept per common position",
        ge=1,
        help=(
            "m: P_ref's most probable entries kept per common position; the KL is taken between the "
            "distributions coarsened to {m entries, tail}, in either direction. Exact at the first step and "
            "with m = |V|; later `ref_to_policy` misses r·KL(tail) and each position's gradient is off by at "
            "most 2r in L1 (r: the reference's tail mass, logged at build), `policy_to_ref` misses "
            "Q·KL(tail) (Q: the policy's tail mass; the bounds and their tests: "
            "[benchmark.md](benchmark.md#reference-cache-bytes-before-and-after)). Capped at |V|"
        ),
    ) = 512
    reference_cache_dtype: Choice(
        "the cache's precision",
        *CACHE_DTYPES,
        help=(
            "`float32`, or `float16`/`bfloat16` for the cached top-m (log-)probabilities (for "
            "`policy_to_ref` float16 keeps a log-probability of −20 to about 0.01)"
        ),
    ) = "float32"
    reference_cache_max_gib: Number(
        "with auto: host GiB per rank above which the reference model is kept instead",
        ge=0,
        help=(
            "with `auto`: host GiB per rank (every rank caches the whole forget set) above which the "
            "reference model is kept instead. At m = 512 a common position costs 4 KiB: TOFU forget10 on "
            "Llama-3 is ~0.3 GiB, all of MUSE-News raw/forget ~3.1 GiB"
        ),
    ) = 4.0
    local_loss_scale: Choice(
        "none (the paper) | reference: the local loss over the reference's own",
        *LOCAL_LOSS_SCALES,
        help=(
            "`none`: the paper's local loss. `reference`: each initiating position's loss divided by the "
            "reference's own there, (1/K)·Σ_{top-K}(z_ref − mean z_ref)² (cached with the top-K), so the "
            "term is ~1 at the first step whatever the model's logit scale: an option for the utility cliff "
            "studied in [real-model.md](real-model.md), not the paper's loss"
        ),
    ) = "none"
    log_term_gradient_norms: Choice(
        "true: log each weighted term's gradient norm (not under DeepSpeed)",
        *BOOLEAN,
        help=(
            "`true`: each logging step also logs `grad_norm_local`, `grad_norm_kl` and `grad_norm_retain`, "
            "the gradient norm of each weighted term (gamma·local, gamma·λ·KL, alpha·retain) before "
            "clipping, from one extra backward pass per term on that step's last micro-batch. Refused under "
            "DeepSpeed (ZeRO-3 partitions the gradients)"
        ),
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
