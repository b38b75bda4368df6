"""The architectures users move to on transformers 4.51 (Qwen3, Gemma 2, Gemma 3), beside Llama: PALU's own
projection equals the model's `forward().logits`, the forward computes one position's logits when PALU asks
for one, and a PALU step projecting at the loss positions gives the full-logits step's loss and gradients.

Every architecture the installed transformers has is tested, tied and untied; Qwen3 and Gemma 3 arrived in
transformers 4.51 (a test holds the 4.51 stack to having them). The output projection's weights are scaled
up so that logits reach tens, where Gemma's soft-cap (30·tanh(z/30)) changes them by whole units: a
projection that skipped the cap fails by far more than the tolerance.
"""

import logging

import pytest
import torch
import transformers
from packaging.version import Version
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from palu_lab.tiny import make_tiny_model
from palu_trainer.framework.stack import logits_to_keep_keyword
from palu_trainer.training.projection import PROJECTED_MODEL_TYPES, SOFTCAPPED_MODEL_TYPES, logit_projection

from .test_trainer import drift, loss_and_gradients

# Gemma 3's config caps no logits by default; a config can ask for it, as Gemma 2's does (30).
CONFIG_OVERRIDES = {
    "gemma2": {"attn_implementation": "eager"},
    "gemma3_text": {"attn_implementation": "eager", "final_logit_softcapping": 30.0},
}
ARCHITECTURES = [model_type for model_type in PROJECTED_MODEL_TYPES if model_type in CONFIG_MAPPING]
HEAD_SCALE = 300.0
pytestmark = pytest.mark.stack


def tiny(tokenizer, model_type, tied, seed=0):
    overrides = dict(CONFIG_OVERRIDES.get(model_type, {}))
    attention = overrides.pop("attn_implementation", None)
    model = make_tiny_model(
        tokenizer, model_type=model_type, tie_word_embeddings=tied, seed=seed, **overrides
    )
    if attention:
        model.config._attn_implementation = attention
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    return model


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model_type(request):
    return request.param


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tied(request):
    return request.param


def test_the_451_stack_has_the_new_architectures():
    if Version(transformers.__version__) >= Version("4.51"):
        assert {"qwen3", "gemma2", "gemma3_text"} <= set(ARCHITECTURES)
    assert {"llama", "gemma2"} <= set(ARCHITECTURES)


def test_projection_is_the_forward_logits(tokenizer, model_type, tied):
    model = tiny(tokenizer, model_type, tied).eval()
    input_ids = torch.tensor([tokenizer("Ann Lee was born in Oslo, Norway, in 1961.")["input_ids"]])
    with torch.no_grad():
        outputs = model(input_ids=input_ids, output_hidden_states=True)
        project, how = logit_projection(model)
        assert project is not None, how
        projected = project(outputs.hidden_states[-1])
        raw = model.get_output_embeddings()(outputs.hidden_states[-1])
    assert outputs.logits.abs().max() > 10  # large enough for the cap to matter
    torch.testing.assert_close(projected, outputs.logits, rtol=1e-5, atol=1e-4)
    if model_type in SOFTCAPPED_MODEL_TYPES:
        assert "soft-capped at 30" in how
        assert (raw - outputs.logits).abs().max() > 1.0  # the cap is real: skipping it would fail above
        assert outputs.logits.abs().max() <= 30.0


def test_forward_computes_one_position_when_asked(tokenizer, model_type):
    model = tiny(tokenizer, model_type, tied=True)
    keyword = logits_to_keep_keyword(model)
    assert keyword is not None
    input_ids = torch.tensor([tokenizer("Ann Lee was born in Oslo.")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=input_ids, **{keyword: 1}).logits
    assert logits.shape == (1, 1, len(tokenizer))


def test_other_architectures_fall_back_to_full_logits_and_say_why(make_trainer, tokenizer, caplog):
    model = make_tiny_model(tokenizer, model_type="gpt2")
    project, why = logit_projection(model)
    assert project is None
    assert "model_type=gpt2: its logits may be scaled or capped" in why and "gemma2" in why
    with caplog.at_level(logging.WARNING, logger="palu_trainer.framework.trainers.palu"):
        trainer = make_trainer(model=model, top_k=64, reference_cache=False)
    assert not trainer.projects_at_positions
    assert f"full logits at every position: {why}" in caplog.text
    batch = trainer.data_collator([trainer.train_dataset[i] for i in (0, 1, 2)])
    assert torch.isfinite(trainer.compute_loss(trainer.model, batch))


def test_palu_step_at_positions_is_the_full_logits_step(make_trainer, tokenizer, model_type, tied):
    """Loss and gradients; and every forward of the policy in the step returns one position's logits."""
    fast, full = (
        make_trainer(model=tiny(tokenizer, model_type, tied), top_k=64, reference_cache=False) for _ in "ab"
    )
    full.projects_at_positions = False
    assert fast.projects_at_positions and fast.logits_to_keep is not None
    drift(fast.model, full.model)
    batch = fast.data_collator([fast.train_dataset[i] for i in (0, 1, 2)])
    shapes = []
    hook = fast.model.register_forward_hook(
        lambda module, args, output: shapes.append(output.logits.shape[1])
    )
    fast_loss, fast_grads = loss_and_gradients(fast, batch)
    hook.remove()
    full_loss, full_grads = loss_and_gradients(full, batch)
    assert shapes == [1, 1]  # forget and retain forwards
    torch.testing.assert_close(fast_loss, full_loss, rtol=1e-5, atol=0)
    for name, gradient in full_grads.items():
        scale = float(gradient.abs().max())
        torch.testing.assert_close(fast_grads[name], gradient, rtol=1e-4, atol=1e-5 * scale, msg=name)
