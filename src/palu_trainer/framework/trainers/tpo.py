"""TPOTrainer: TPO's released `tpo_grad_diff` loss on this plugin's span-role forget batches."""

import torch

from palu_trainer.framework.datasets import require_token_roles
from palu_trainer.framework.trainers.guarded import GuardedGradDiff
from palu_trainer.method.tpo_losses import tpo_preference_loss, tpo_preservation_loss
from palu_trainer.options import TPOOptions


class TPOTrainer(GuardedGradDiff):
    """loss = gamma·(LPL + PL) + alpha·retain (released: all weights 1, retain NLL).

    Its options (`trainer.method_args`) are `TPOOptions`. Sensitive tokens are the forget batches' span
    tokens (`token_roles` INITIATING or REDUNDANT: N plays no part); common tokens get the preservation loss.
    """

    options_type = TPOOptions

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.beta = self.options.beta
        require_token_roles(self, "TPO", "experiment=unlearn/tofu/tpo")
        if self.ref_model is None:
            self.ref_model = self._prepare_ref_model(self.model)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        forget = inputs["forget"]
        forward_inputs = {"input_ids": forget["input_ids"], "attention_mask": forget["attention_mask"]}
        forget_outputs = model(**forward_inputs)
        with torch.no_grad():
            reference_logits = self.ref_model(**forward_inputs).logits
        input_ids, roles = forget["input_ids"], forget["token_roles"]
        preference = tpo_preference_loss(forget_outputs.logits, reference_logits, input_ids, roles, self.beta)
        preservation = tpo_preservation_loss(forget_outputs.logits, input_ids, roles)

        retain = inputs["retain"]
        retain_inputs = {key: retain[key] for key in ("input_ids", "attention_mask", "labels")}
        retain_loss = self.compute_retain_loss(model=model, retain_inputs=retain_inputs)

        loss = self.gamma * (preference + preservation) + self.alpha * retain_loss
        terms = {"preference": preference, "preservation": preservation, "retain": retain_loss}
        self.last_terms = {name: float(term.detach()) for name, term in terms.items()}  # named if non-finite
        return (loss, forget_outputs) if return_outputs else loss
