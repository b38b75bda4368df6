"""TPOTrainer in-process: its loss is the pure TPO terms plus the retain NLL, and training moves the model."""

import pytest
import torch

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.framework.trainers.tpo import TPOTrainer
from palu_trainer.method.tpo_losses import tpo_preference_loss, tpo_preservation_loss
from palu_trainer.training.run_guard import RunStopped


def test_loss_is_preference_plus_preservation_plus_retain(make_trainer):
    trainer = make_trainer(trainer_class=TPOTrainer, beta=0.5, alpha=2.0)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    forget, retain = batch["forget"], batch["retain"]
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
        logits = trainer.model(input_ids=forget["input_ids"], attention_mask=forget["attention_mask"]).logits
        retain_nll = trainer.model(**{k: retain[k] for k in ("input_ids", "attention_mask", "labels")}).loss
    roles = forget["token_roles"]
    preference = tpo_preference_loss(logits, logits, forget["input_ids"], roles, 0.5)
    preservation = tpo_preservation_loss(logits, forget["input_ids"], roles)
    # Before any step the model is its own reference: d = 0, LPL = (2/β)·log 2.
    assert preference.item() == pytest.approx(4 * torch.log(torch.tensor(2.0)).item(), rel=1e-6)
    assert preservation > 0
    torch.testing.assert_close(loss, preference + preservation + 2.0 * retain_nll, rtol=1e-6, atol=1e-6)


def test_training_lowers_the_preference_loss_and_keeps_the_reference(make_trainer):
    trainer = make_trainer(max_steps=3, trainer_class=TPOTrainer)
    reference_before = {name: p.detach().clone() for name, p in trainer.ref_model.named_parameters()}
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])["forget"]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def preference():
        with torch.no_grad():
            logits, reference = trainer.model(**inputs).logits, trainer.ref_model(**inputs).logits
        return tpo_preference_loss(logits, reference, batch["input_ids"], batch["token_roles"], trainer.beta)

    before = preference()
    trainer.train()
    assert preference() < before
    for name, parameter in trainer.ref_model.named_parameters():
        assert torch.equal(parameter, reference_before[name]), name


def test_forget_batches_without_roles_are_rejected(make_trainer):
    ensure_importable()
    from data.collators import DataCollatorForSupervisedDataset

    with pytest.raises(RunStopped, match="TPO needs token roles in the forget batches.*unlearn/tofu/tpo"):
        make_trainer(trainer_class=TPOTrainer, collator=DataCollatorForSupervisedDataset)
