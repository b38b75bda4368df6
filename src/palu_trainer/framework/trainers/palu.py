"""PALUTrainer: wires the pure PALU losses into open-unlearning's GradDiff family."""

import logging

import torch

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.framework.datasets import require_token_roles
from palu_trainer.framework.projection import logit_projection
from palu_trainer.framework.stack import logits_to_keep_keyword
from palu_trainer.framework.trainers.checkpointing import use_non_reentrant_checkpointing
from palu_trainer.framework.vocabulary import reachable_vocab_size
from palu_trainer.method.losses import (
    ReferenceFromModel,
    check_choice,
    check_kl_direction,
    check_kl_weight,
    check_local_loss_scale,
    check_loss_weights,
    check_number,
    check_target,
    check_top_k,
    chunk_count,
    forget_hidden,
    forget_rows,
    label_nll_at_positions,
    label_positions,
    logit_chunk_rows,
    palu_forget_loss,
    palu_forget_loss_at_positions,
    palu_terms,
    reference_targets_at_positions,
    resolve_top_k,
    select_predictions,
    targets_from_selected,
    term_gradient_norms,
)
from palu_trainer.method.reference_cache import (
    build_reference_cache,
    cache_dtype,
    check_top_m,
    count_positions,
    describe,
    estimated_nbytes,
    resolve_top_m,
)
from palu_trainer.method.roles import count_roles

ensure_importable()
from trainer.unlearn.grad_diff import GradDiff  # noqa: E402

logger = logging.getLogger(__name__)

RETAIN_LOSS_TYPES = ("NLL", "KL", "none")
LOGGED_TERMS = ("local_loss", "kl_loss", "retain_loss", "n_initiating", "n_common", "n_redundant")


class PALUTrainer(GradDiff):
    """loss = gamma·(local + kl_weight·KL) + alpha·retain, with retain ∈ {NLL, KL, none}.

    Args (method_args):
        top_k: K, the reference's top-K vocabulary entries that the local loss flattens: a positive
            integer (capped at |V|), `all`, or a share of |V| in (0, 1] (see `resolve_top_k`).
        target: c of the local loss: global_mean, topk_mean, ref_mean, uniform or zero.
        target_gradient: false (the paper: c is a fixed target) or true (the released code: gradient flows
            through c).
        kl_direction: ref_to_policy, KL(P_ref ‖ P_θ) (the paper), or policy_to_ref, KL(P_θ ‖ P_ref) (the
            released code).
        kl_weight: λ >= 0, the weight of the KL term on common tokens, or `alpha`: the released code's
            loss gamma·local + alpha·KL + alpha·retain.
        merge_adjacent_spans: must match the forget dataset's initiating policy (the experiment passes this
            value to it): spans with no token between them are one span (the released code).
        reference_cache: `auto` (default: on unless retain_loss_type is KL or the cache would exceed
            `reference_cache_max_gib`), true or false. On: before the first step the policy, whose weights
            are still the reference, runs once over the forget set and PALU's reference targets are kept
            per row on host memory; no reference model exists.
        reference_cache_top_m: m, the reference's most probable entries kept per common position; the
            rest of its mass is one tail bucket and the KL is taken between the coarsened distributions
            (exact at the first step; later the error is bounded by the tail mass, which the build logs).
            Capped at |V|.
        reference_cache_dtype: float32, float16 or bfloat16, for the cached (log-)probabilities.
        reference_cache_max_gib: with `auto`, the cache is only built when its estimate (per rank: every
            rank holds the whole forget set) fits this budget; above it the reference model is kept
            instead, and the log says why.
        local_loss_scale: `none` (the paper's local loss) or `reference` (each initiating position's loss
            divided by the reference's own there: scale-free, ~1 at the first step; an option for the
            utility cliff of docs/real-model.md, not the paper's loss).
        log_term_gradient_norms: at each logging step, also log the gradient norm of each weighted term
            (gamma·local, gamma·λ·KL, alpha·retain: `grad_norm_local`, `grad_norm_kl`, `grad_norm_retain`),
            before clipping, from one extra backward pass per term on that step's micro-batch. Not under
            DeepSpeed (its partitioned gradients are not the parameters' `.grad`).

    Logits are projected only where a loss reads them (forget: initiating and common positions; retain
    NLL: label positions), LOGIT_CHUNK_ELEMENTS at a time under activation checkpointing, for the models
    whose logits `projection.logit_projection` reproduces; other models get full logits.

    Token roles come with the forget batches (`token_roles`, fixed by the forget dataset's initiating
    policy: QAwithSpansDataset and DataCollatorWithTokenRoles).
    """

    # method_args that moved elsewhere: the message says where (checked by palu-train before loading too).
    MOVED_METHOD_ARGS = {
        "num_initiating_tokens": "num_initiating_tokens (N) belongs to the forget dataset, which fixes token "
        "roles: set it with the experiment's top-level `num_initiating_tokens=N`, not trainer.method_args",
    }

    def __init__(
        self,
        top_k=0.15625,
        target="global_mean",
        target_gradient=False,
        kl_direction="ref_to_policy",
        kl_weight=1.0,
        merge_adjacent_spans=False,
        reference_cache="auto",
        reference_cache_top_m=512,
        reference_cache_dtype="float32",
        reference_cache_max_gib=4.0,
        local_loss_scale="none",
        log_term_gradient_norms=False,
        *args,
        **kwargs,
    ):
        self.check_method_args(
            {
                **kwargs,
                "top_k": top_k,
                "target": target,
                "target_gradient": target_gradient,
                "kl_direction": kl_direction,
                "kl_weight": kl_weight,
                "merge_adjacent_spans": merge_adjacent_spans,
                "reference_cache": reference_cache,
                "reference_cache_top_m": reference_cache_top_m,
                "reference_cache_dtype": reference_cache_dtype,
                "reference_cache_max_gib": reference_cache_max_gib,
                "local_loss_scale": local_loss_scale,
                "log_term_gradient_norms": log_term_gradient_norms,
            }
        )
        super().__init__(*args, **kwargs)
        # The loss is a mean over each micro-batch: the Trainer divides it by the accumulation steps itself
        # (transformers >= 4.46 skips that for models that take loss kwargs, expecting num_items_in_batch).
        self.model_accepts_loss_kwargs = False
        use_non_reentrant_checkpointing(self.args)
        self.target = target
        self.target_gradient = target_gradient
        self.kl_direction = kl_direction
        self.kl_weight = kl_weight
        self.local_loss_scale = local_loss_scale
        self.log_term_gradient_norms = bool(log_term_gradient_norms)
        if self.log_term_gradient_norms and self.is_deepspeed_enabled:
            raise ValueError(
                "method_args.log_term_gradient_norms=true reads each term's gradient from the parameters, "
                "which ZeRO-3 partitions: run it without DeepSpeed (one process or DDP)"
            )
        self._term_gradient_norms: dict[str, float] = {}
        self.top_k = resolve_top_k(top_k, reachable_vocab_size(self.model, self._tokenizer()))
        self._check_forget_batches(merge_adjacent_spans)
        self.reference_cache_dtype = cache_dtype(reference_cache_dtype)
        self.reference_cache_max_gib = float(reference_cache_max_gib)
        self.reference_cache_top_m = resolve_top_m(reference_cache_top_m, self.model.config.vocab_size)
        projection, how = logit_projection(self.model)
        self.projects_at_positions = projection is not None
        self.logits_to_keep = logits_to_keep_keyword(self.accelerator.unwrap_model(self.model))
        if not self.projects_at_positions:
            logger.warning("full logits at every position: %s", how)
        elif self.logits_to_keep is None:
            logger.warning(
                "%s.forward takes neither logits_to_keep nor num_logits_to_keep: every forward also computes "
                "all positions' logits, which PALU does not read (%s)",
                type(self.model).__name__,
                how,
            )
        else:
            logger.info(
                "logits at the loss positions only (%s=1 in the forward): %s", self.logits_to_keep, how
            )
        self.logit_chunk_rows = logit_chunk_rows(self.model.config.vocab_size)
        self.uses_reference_cache = self._cache_wanted(reference_cache)
        self.reference_cache = None
        if not self.uses_reference_cache and self.ref_model is None:
            self.ref_model = self._prepare_ref_model(self.model)
        self._term_sums = torch.zeros(len(LOGGED_TERMS), dtype=torch.float64)
        self._term_batches = 0

    @classmethod
    def check_method_args(cls, options: dict) -> None:
        """Refuse bad `method_args` values; palu-train calls it on the composed config before loading."""
        for moved in cls.MOVED_METHOD_ARGS.keys() & options.keys():
            raise ValueError(cls.MOVED_METHOD_ARGS[moved])
        check_loss_weights(options)
        checks = {
            "retain_loss_type": lambda value: check_choice("retain_loss_type", value, RETAIN_LOSS_TYPES),
            "top_k": check_top_k,
            "target": check_target,
            "target_gradient": lambda value: check_choice("target_gradient", value, (True, False)),
            "kl_direction": check_kl_direction,
            "kl_weight": check_kl_weight,
            "merge_adjacent_spans": lambda value: check_choice("merge_adjacent_spans", value, (True, False)),
            "reference_cache": lambda value: check_choice("reference_cache", value, ("auto", True, False)),
            "reference_cache_top_m": check_top_m,
            "reference_cache_dtype": cache_dtype,
            "reference_cache_max_gib": lambda value: check_number(
                "reference_cache_max_gib", value, "host GiB per rank that reference_cache=auto may use"
            ),
            "local_loss_scale": check_local_loss_scale,
            "log_term_gradient_norms": lambda value: check_choice(
                "log_term_gradient_norms", value, (True, False)
            ),
        }
        for name, check in checks.items():
            if name in options:
                check(options[name])

    def _tokenizer(self):
        return getattr(self, "processing_class", None) or getattr(self, "tokenizer", None)

    def _check_forget_batches(self, merge_adjacent_spans):
        forget = getattr(self.train_dataset, "forget", None)
        if forget is None or len(forget) == 0:
            return
        policy = getattr(forget, "initiating_policy", None)
        if policy is not None and policy.merge_adjacent_spans != merge_adjacent_spans:
            raise ValueError(
                f"method_args.merge_adjacent_spans={merge_adjacent_spans} but the forget dataset's "
                f"initiating policy has merge_adjacent_spans={policy.merge_adjacent_spans}: pass the "
                "trainer's value to the dataset (experiment=unlearn/tofu/palu does)"
            )
        require_token_roles(self, "PALU", "experiment=unlearn/tofu/palu")

    def _cache_wanted(self, reference_cache) -> bool:
        if reference_cache and self.retain_loss_type == "KL":
            logger.info(
                "retain_loss_type=KL reads the reference on retain rows: reference model kept, no cache"
            )
            return False
        if reference_cache == "auto":
            return self._cache_fits()
        return bool(reference_cache)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """Resuming builds the reference cache first, from the weights handed to the trainer (the reference:
        the model unlearning started from), before the checkpoint's weights replace them."""
        if resume_from_checkpoint and self.uses_reference_cache and self.reference_cache is None:
            if self.is_deepspeed_enabled:
                raise RuntimeError(
                    "resuming under DeepSpeed loads the checkpoint before the reference cache can be built: "
                    "resume with trainer.method_args.reference_cache=false"
                )
            self.reference_cache = self._build_reference_cache(self.model)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _cache_fits(self) -> bool:
        """Whether the estimated cache of the forget set fits `reference_cache_max_gib` (checked per rank)."""
        forget = getattr(self.train_dataset, "forget", None)
        if forget is None:
            return True
        positions = count_positions(forget[index]["token_roles"] for index in range(len(forget)))
        top_m, dtype = self.reference_cache_top_m, self.reference_cache_dtype
        gib = estimated_nbytes(*positions, self.top_k, top_m, dtype, self.kl_direction) / 2**30
        fits = gib <= self.reference_cache_max_gib
        (logger.info if fits else logger.warning)(
            "reference_cache=auto: the forget set's cache is estimated at %.3f GiB of host memory per rank "
            "(K=%d per initiating position, top m=%d of |V|=%d per common position, in %s); "
            "reference_cache_max_gib=%g: %s",
            gib,
            self.top_k,
            top_m,
            self.model.config.vocab_size,
            str(dtype).removeprefix("torch."),
            self.reference_cache_max_gib,
            "caching"
            if fits
            else "keeping the reference model instead (raise the budget, lower reference_cache_top_m, or set "
            "reference_cache_dtype=bfloat16, to cache)",
        )
        return fits

    def _final_hidden(self, model, inputs):
        """Final hidden states (B, T, d) and the outputs, through the (possibly wrapped) model's own forward
        so that DDP and ZeRO-3 hooks run; only the last position's logits are computed there."""
        keep_one = {self.logits_to_keep: 1} if self.logits_to_keep else {}
        outputs = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            output_hidden_states=True,
            **keep_one,
        )
        return outputs.hidden_states[-1], outputs

    def _output_projection(self, model):
        """The output projection as the model's own forward runs it: called as a module (not its weight) so
        that ZeRO-3 gathers it, tied embeddings included, and under the accelerator's autocast, since
        mixed precision wraps only `model.forward` (whose outputs it converts to fp32) while the weight
        stays in the model's dtype."""
        project_unwrapped = logit_projection(self.accelerator.unwrap_model(model))[0]

        def project(hidden):
            with self.accelerator.autocast():
                return project_unwrapped(hidden)

        return project

    def _reference_targets(self, model, inputs, roles, top_m):
        """The targets of `model` (the reference) for a forget batch, without gradient: top-K at the
        initiating positions and, at the common ones, P_ref in the top-m form (`top_m`; None: all of V)."""
        with torch.no_grad():
            if not self.projects_at_positions:
                selected = select_predictions(model(**inputs).logits, roles)
                return targets_from_selected(*selected, self.top_k, self.kl_direction, top_m)
            hidden, _ = self._final_hidden(model, inputs)
            return reference_targets_at_positions(
                hidden,
                self._output_projection(model),
                roles,
                self.top_k,
                self.kl_direction,
                top_m,
                self.logit_chunk_rows,
            )

    def _build_reference_cache(self, model):
        if self.state.global_step > 0:
            raise RuntimeError(
                f"the reference cache must come from the weights before unlearning, but training is at step "
                f"{self.state.global_step}: resume through train(resume_from_checkpoint=...), which builds "
                "it first, or with reference_cache=false"
            )
        forget = self.train_dataset.forget
        size = self.args.per_device_train_batch_size
        batches = (
            self._prepare_inputs(
                self.data_collator([forget[i] for i in range(start, min(start + size, len(forget)))])
            )
            for start in range(0, len(forget), size)
        )
        was_training = model.training
        model.eval()
        cache = build_reference_cache(
            lambda batch: self._reference_targets(
                model,
                {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
                batch["token_roles"],
                self.reference_cache_top_m,
            ),
            batches,
            self.reference_cache_dtype,
        )
        model.train(was_training)
        logger.info(describe(cache, self.top_k, self.reference_cache_dtype))
        return cache

    def _projection_calls(self, *row_counts: int) -> list[int]:
        """Chunks of `logit_chunk_rows` that each count of positions needs, the most over all ranks: under
        ZeRO-3 every call of the partitioned output projection is a collective, so every rank must make as
        many as the others in each step (forward and checkpointed recompute alike)."""
        counts = torch.tensor([chunk_count(rows, self.logit_chunk_rows) for rows in row_counts])
        if self.accelerator.num_processes > 1:
            counts = counts.to(self.accelerator.device)
            torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
        return counts.tolist()

    def _reference(self, forward_inputs, roles, row_indices):
        """This batch's reference targets: from the cache (by the rows' dataset indices), or from the
        reference model (chunk by chunk inside the loss's chunks when projecting at positions)."""
        if self.uses_reference_cache:
            return self.reference_cache.targets(row_indices, roles, roles.device)
        if not self.projects_at_positions:
            return self._reference_targets(self.ref_model, forward_inputs, roles, top_m=None)
        with torch.no_grad():
            hidden, _ = self._final_hidden(self.ref_model, forward_inputs)
        return ReferenceFromModel(
            *forget_hidden(hidden, roles),
            self._output_projection(self.ref_model),
            self.top_k,
            self.kl_direction,
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.uses_reference_cache and self.reference_cache is None:
            self.reference_cache = self._build_reference_cache(model)
        forget = inputs["forget"]
        forward_inputs = {"input_ids": forget["input_ids"], "attention_mask": forget["attention_mask"]}
        roles = forget["token_roles"]
        reference = self._reference(forward_inputs, roles, forget["index"])
        loss_options = (self.target, self.target_gradient, self.kl_direction)
        scale = {"local_loss_scale": self.local_loss_scale}
        retain_at_positions = self.retain_loss_type == "NLL" and self.projects_at_positions
        if self.projects_at_positions:
            retain_labels = inputs["retain"]["labels"] if retain_at_positions else None
            *forget_calls, retain_calls = self._projection_calls(
                *(len(rows) for rows in forget_rows(roles)),
                0 if retain_labels is None else len(label_positions(retain_labels)),
            )
            hidden, forget_outputs = self._final_hidden(model, forward_inputs)
            local_loss, kl_loss = palu_forget_loss_at_positions(
                hidden,
                self._output_projection(model),
                roles,
                reference,
                *loss_options,
                self.logit_chunk_rows,
                forget_calls,
                recompute=not self.is_deepspeed_enabled,
                **scale,
            )
        else:
            forget_outputs = model(**forward_inputs)
            local_loss, kl_loss = palu_forget_loss(
                forget_outputs.logits, roles, reference, *loss_options, **scale
            )

        if self.retain_loss_type == "none":
            retain_loss = torch.zeros((), device=local_loss.device)
        else:
            retain = inputs["retain"]
            retain_inputs = {key: retain[key] for key in ("input_ids", "attention_mask", "labels")}
            if retain_at_positions:
                hidden, _ = self._final_hidden(model, retain_inputs)
                retain_loss = label_nll_at_positions(
                    hidden,
                    self._output_projection(model),
                    retain_inputs["labels"],
                    self.logit_chunk_rows,
                    retain_calls,
                    recompute=not self.is_deepspeed_enabled,
                )
            else:
                retain_loss = self.compute_retain_loss(model=model, retain_inputs=retain_inputs)

        terms = palu_terms(local_loss, kl_loss, retain_loss, self.gamma, self.alpha, self.kl_weight)
        loss = sum(terms)
        self._record_terms(local_loss, kl_loss, retain_loss, roles)
        if self.log_term_gradient_norms and model.training and self._logs_after_this_step():
            self._term_gradient_norms = term_gradient_norms(
                dict(zip(("local", "kl", "retain"), terms)),
                [parameter for parameter in model.parameters() if parameter.requires_grad],
            )
        return (loss, forget_outputs) if return_outputs else loss

    def _logs_after_this_step(self) -> bool:
        """Whether the optimizer step this micro-batch belongs to ends in a training log (the Trainer's
        rule: the first step with logging_first_step, then every logging_steps)."""
        step = self.state.global_step + 1
        first = step == 1 and self.args.logging_first_step
        return first or (self.args.logging_steps > 0 and step % self.args.logging_steps == 0)

    def _record_terms(self, local_loss, kl_loss, retain_loss, roles):
        counts = count_roles(roles)
        values = [float(term.detach()) for term in (local_loss, kl_loss, retain_loss)] + [
            counts[key] for key in LOGGED_TERMS[3:]
        ]
        self.last_terms = dict(zip(("local", "kl", "retain"), values[:3]))  # named when one is non-finite
        self._term_sums += torch.tensor(values, dtype=torch.float64)
        self._term_batches += 1

    def log(self, logs, *args, **kwargs):
        """Add the mean of each PALU term since the last training log; token counts are per global batch.
        (transformers >= 4.47 passes the Trainer's `start_time` too: handed on unchanged.)"""
        if "loss" in logs and self._term_batches:
            totals = torch.cat([self._term_sums, torch.tensor([self._term_batches], dtype=torch.float64)])
            if self.accelerator.num_processes > 1:
                totals = self.accelerator.reduce(totals.to(self.accelerator.device), reduction="sum").cpu()
            steps = totals[-1] / (self.accelerator.num_processes * self.args.gradient_accumulation_steps)
            means = totals[:-1] / totals[-1]
            means[3:] = totals[3:-1] / steps  # counts: per optimizer step, over all ranks and micro-batches
            logs = {**logs, **{name: round(float(value), 4) for name, value in zip(LOGGED_TERMS, means)}}
            logs |= {
                f"grad_norm_{name}": round(value, 4) for name, value in self._term_gradient_norms.items()
            }
            self._term_gradient_norms = {}
            self._term_sums.zero_()
            self._term_batches = 0
        super().log(logs, *args, **kwargs)
