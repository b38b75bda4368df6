"""PALUTrainer: wires PALU's objective (palu_trainer.method) into open-unlearning's GradDiff family."""

import logging
from pathlib import Path

import torch

from palu_trainer.framework.datasets import require_token_roles
from palu_trainer.framework.lora import adapters_disabled, base_model
from palu_trainer.framework.stack import logits_to_keep_keyword
from palu_trainer.framework.trainers.guarded import GuardedGradDiff
from palu_trainer.method.chunking import ProjectionCalls, chunk_count, logit_chunk_rows
from palu_trainer.method.local_loss import resolve_top_k
from palu_trainer.method.objective import PALUTerms, term_gradient_norms
from palu_trainer.method.reference import Reference
from palu_trainer.method.reference_cache import (
    CACHE_DTYPES,
    ReferenceCache,
    build_reference_cache,
    count_positions,
    describe,
    estimated_nbytes,
)
from palu_trainer.method.roles import count_roles, forget_rows, label_positions
from palu_trainer.options import PALUOptions
from palu_trainer.training.projection import logit_projection
from palu_trainer.training.run_guard import RunStopped
from palu_trainer.training.vocabulary import reachable_vocab_size

logger = logging.getLogger(__name__)

REFERENCE_CACHE_FILE = "palu_reference_cache.safetensors"
LOGGED_TERMS = ("local_loss", "kl_loss", "retain_loss", "n_initiating", "n_common", "n_redundant")


class PALUTrainer(GuardedGradDiff):
    """PALU in open-unlearning's GradDiff family: loss = gamma·(local + λ·KL) + alpha·retain, retain one of
    NLL, KL or none. Its options (`trainer.method_args`) are `PALUOptions` (docs/method.md).

    Logits are projected only where a loss reads them (forget: initiating and common positions; retain
    NLL: label positions), a chunk at a time under activation checkpointing, for the models whose logits
    `projection.logit_projection` reproduces; other models hand their full logits to the same losses.
    The reference's targets come from a cache built before the first step (`reference_cache`), or from a
    frozen reference model every step. Token roles come with the forget batches (`token_roles`).
    """

    options_type = PALUOptions

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        options = self.options
        if options.log_term_gradient_norms and self.is_deepspeed_enabled:
            raise ValueError(
                "method_args.log_term_gradient_norms=true reads each term's gradient from the parameters, "
                "which ZeRO-3 partitions: run it without DeepSpeed (one process or DDP)"
            )
        self._term_gradient_norms: dict[str, float] = {}
        self._check_forget_batches()
        vocab_size = self.model.config.vocab_size
        tokenizer = getattr(self, "processing_class", None) or getattr(self, "tokenizer", None)
        top_k = resolve_top_k(options.top_k, reachable_vocab_size(self.model, tokenizer))
        self.objective = options.objective(top_k, chunk_rows=logit_chunk_rows(vocab_size))
        self.reference_cache_dtype = CACHE_DTYPES[options.reference_cache_dtype]
        self.reference_cache_top_m = min(options.reference_cache_top_m, vocab_size)  # |V|: the exact KL
        self.projects_at_positions = self._log_projection()
        self.uses_reference_cache = self._cache_wanted(options.reference_cache)
        self.reference_cache = None
        if not self.uses_reference_cache and self.ref_model is None:
            self.ref_model = self._prepare_ref_model(self.model)
        self._term_sums = torch.zeros(len(LOGGED_TERMS) + 1, dtype=torch.float64)  # and the micro-batches

    def _log_projection(self) -> bool:
        """Whether logits are projected at the loss positions only (logged, or why not)."""
        projection, how = logit_projection(self.model)
        self.logits_to_keep = logits_to_keep_keyword(base_model(self.accelerator.unwrap_model(self.model)))
        if projection is None:
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
        return projection is not None

    def _check_forget_batches(self):
        policy = getattr(getattr(self.train_dataset, "forget", None), "initiating_policy", None)
        merge_adjacent_spans = self.options.merge_adjacent_spans
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

    def _reference_cache_settings(self) -> dict[str, str]:
        """What the cached targets depend on besides the starting model and the forget data."""
        return {
            "top_k": str(self.objective.top_k),
            "kl_direction": self.objective.kl_direction,
            "reference_cache_top_m": str(self.reference_cache_top_m),
            "reference_cache_dtype": str(self.reference_cache_dtype).removeprefix("torch."),
        }

    def save_checkpoint_state(self, folder: Path) -> None:
        """The reference cache travels with each resumable checkpoint, so that a resumed run reads the
        targets it started with, on any number of ranks (each holds the whole cache; rank 0 writes it)."""
        if (
            self.reference_cache is not None
            and not self.args.save_only_model
            and self.is_world_process_zero()
        ):
            self.reference_cache.save(folder / REFERENCE_CACHE_FILE, self._reference_cache_settings())

    def before_resuming(self, checkpoint: str) -> None:
        """The reference cache of a resumed run: the checkpoint's, else built from the weights handed to the
        trainer (the reference: the model unlearning started from), before the checkpoint's replace them.
        Under DeepSpeed the weights load with the engine, before a cache could be built: the checkpoint's
        is needed."""
        if not self.uses_reference_cache or self.reference_cache is not None:
            return
        saved = Path(checkpoint) / REFERENCE_CACHE_FILE
        if saved.is_file():
            cache, settings = ReferenceCache.load(saved)
            wanted = self._reference_cache_settings()
            if settings != wanted:
                raise RunStopped(
                    f"{saved} was built with {settings}, this run asks for {wanted}: resume with the "
                    "options the run started with"
                )
            self.reference_cache = cache
            logger.info(
                "reference cache read from %s: %s",
                saved,
                describe(cache, self.objective.top_k, self.reference_cache_dtype),
            )
        elif self.is_deepspeed_enabled:
            raise RunStopped(
                f"{checkpoint} holds no reference cache ({REFERENCE_CACHE_FILE}), and under DeepSpeed it "
                "cannot be rebuilt before the checkpoint's weights load: resume from a checkpoint this "
                "version wrote, or start the run again"
            )
        else:
            self.reference_cache = self._build_reference_cache(self.model)

    def _estimated_cache_bytes(self) -> int:
        """Host bytes of the forget set's reference cache, estimated before it is built."""
        forget = getattr(self.train_dataset, "forget", None)
        if forget is None:
            return 0
        positions = count_positions(forget[index]["token_roles"] for index in range(len(forget)))
        top_k, top_m, dtype = self.objective.top_k, self.reference_cache_top_m, self.reference_cache_dtype
        return estimated_nbytes(*positions, top_k, top_m, dtype, self.objective.kl_direction)

    def checkpoint_state_bytes(self) -> int:
        """The reference cache that each resumable checkpoint holds (`save_checkpoint_state`)."""
        return (
            self._estimated_cache_bytes()
            if self.uses_reference_cache and not self.args.save_only_model
            else 0
        )

    def _cache_fits(self) -> bool:
        """Whether the estimated cache of the forget set fits `reference_cache_max_gib` (checked per rank)."""
        if getattr(self.train_dataset, "forget", None) is None:
            return True
        top_k, top_m, dtype = self.objective.top_k, self.reference_cache_top_m, self.reference_cache_dtype
        gib = self._estimated_cache_bytes() / 2**30
        fits = gib <= self.options.reference_cache_max_gib
        (logger.info if fits else logger.warning)(
            "reference_cache=auto: the forget set's cache is estimated at %.3f GiB of host memory per rank "
            "(K=%d per initiating position, top m=%d of |V|=%d per common position, in %s); "
            "reference_cache_max_gib=%g: %s",
            gib,
            top_k,
            top_m,
            self.model.config.vocab_size,
            str(dtype).removeprefix("torch."),
            self.options.reference_cache_max_gib,
            "caching"
            if fits
            else "keeping the reference model instead (raise the budget, lower reference_cache_top_m, or set "
            "reference_cache_dtype=bfloat16, to cache)",
        )
        return fits

    def _forward(self, model, batch):
        """(states, project, outputs) of `batch` through the (possibly wrapped) model's own forward, so that
        DDP and ZeRO-3 hooks run: the final hidden states (B, T, d) and the output projection, with only the
        last position's logits computed in the forward; or, for a model whose logits PALU cannot recompute,
        its logits (B, T, V) and no projection."""
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if not self.projects_at_positions:
            outputs = model(**inputs)
            return outputs.logits, None, outputs
        keep_one = {self.logits_to_keep: 1} if self.logits_to_keep else {}
        outputs = model(**inputs, output_hidden_states=True, **keep_one)
        return outputs.hidden_states[-1], self._output_projection(model), outputs

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

    def _build_reference_cache(self, model):
        if self.state.global_step > 0:
            raise RuntimeError(
                f"the reference cache must come from the weights before unlearning, but training is at step "
                f"{self.state.global_step}: resume through train(resume_from_checkpoint=...), which builds "
                "it first, or with reference_cache=false"
            )
        # batches by hand: a DataLoader draws its seed from torch's global generator, which would shift the
        # run's random stream (every later shuffle and dropout) by building the cache
        forget, size = self.train_dataset.forget, self.args.per_device_train_batch_size
        collated = (
            self.data_collator([forget[i] for i in range(start, min(start + size, len(forget)))])
            for start in range(0, len(forget), size)
        )

        def targets(batch):  # the weights before unlearning, in the cache's top-m form
            states, project, _ = self._forward(model, batch)
            return self.objective.reference(states, batch["token_roles"], project, self.reference_cache_top_m)

        was_training = model.training
        model.eval()
        with adapters_disabled(self.accelerator.unwrap_model(model)):  # a LoRA run's reference: the base
            batches = map(self._prepare_inputs, collated)
            cache = build_reference_cache(targets, batches, self.reference_cache_dtype)
        model.train(was_training)
        logger.info(describe(cache, self.objective.top_k, self.reference_cache_dtype))
        return cache

    def _projection_calls(self, roles, retain_labels) -> ProjectionCalls:
        """Projection calls of this step: the chunks each count of positions needs, the most over all ranks.
        Under ZeRO-3 every call of the partitioned output projection is a collective, so every rank must
        make as many as the others in each step, and chunks are kept for the backward, not recomputed (see
        `chunking.mean_over_chunks`)."""
        chunk_rows = self.objective.chunk_rows
        rows = [*(len(each) for each in forget_rows(roles)), len(label_positions(retain_labels))]
        counts = torch.tensor([chunk_count(count, chunk_rows) for count in rows])
        if self.accelerator.num_processes > 1:
            counts = counts.to(self.accelerator.device)
            torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
        return ProjectionCalls(*counts.tolist(), recompute=not self.is_deepspeed_enabled)

    def _reference(self, forget) -> Reference:
        roles = forget["token_roles"]
        if self.uses_reference_cache:
            return self.reference_cache.targets(forget["index"], roles, roles.device)
        with torch.no_grad():
            states, project, _ = self._forward(self.ref_model, forget)
        return self.objective.model_reference(states, roles, project)

    def _retain_loss(self, model, retain, calls, device) -> torch.Tensor:
        if self.retain_loss_type == "none":
            return torch.zeros((), device=device)
        retain = {key: retain[key] for key in ("input_ids", "attention_mask", "labels")}
        if self.retain_loss_type == "KL":
            return self.compute_retain_loss(model=model, retain_inputs=retain)
        states, project, _ = self._forward(model, retain)
        return self.objective.retain_nll(states, project, retain["labels"], calls)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.uses_reference_cache and self.reference_cache is None:
            self.reference_cache = self._build_reference_cache(model)
        forget, retain = inputs["forget"], inputs.get("retain")
        roles = forget["token_roles"]
        retain_labels = retain["labels"] if self.retain_loss_type == "NLL" else roles[:, :0]
        calls = self._projection_calls(roles, retain_labels)
        reference = self._reference(forget)
        states, project, outputs = self._forward(model, forget)
        # the forget terms' graph first: autograd accumulates shared parameters' gradients in that order
        local, kl = self.objective.forget_terms(states, project, roles, reference, calls)
        terms = self.objective.weigh(local, kl, self._retain_loss(model, retain, calls, local.device))
        self._record_terms(terms, roles, model)
        return (terms.loss, outputs) if return_outputs else terms.loss

    def _logs_after_this_step(self) -> bool:
        """Whether this micro-batch's optimizer step ends in a training log (the Trainer's rule)."""
        step = self.state.global_step + 1
        first = step == 1 and self.args.logging_first_step
        return first or (self.args.logging_steps > 0 and step % self.args.logging_steps == 0)

    def _record_terms(self, terms: PALUTerms, roles, model):
        counts = count_roles(roles)
        values = [float(term.detach()) for term in (terms.local, terms.kl, terms.retain)]
        self.last_terms = dict(zip(("local", "kl", "retain"), values))  # named when one is non-finite
        values += [*(counts[key] for key in LOGGED_TERMS[3:]), 1]
        self._term_sums += torch.tensor(values, dtype=torch.float64)
        if self.options.log_term_gradient_norms and model.training and self._logs_after_this_step():
            parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
            self._term_gradient_norms = term_gradient_norms(terms.weighted, parameters)

    def log(self, logs, *args, **kwargs):
        """Add the mean of each PALU term since the last training log; token counts are per global batch.
        (transformers >= 4.47 passes the Trainer's `start_time` too: handed on unchanged.)"""
        if "loss" in logs and self._term_sums[-1]:
            totals = self._term_sums
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
        super().log(logs, *args, **kwargs)
