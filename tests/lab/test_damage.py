"""palu_lab.damage (issue 59) on a tiny Llama and the shared TOFU sets: the reference against itself has no
damage, a shift of every logit is seen as a shift and not as KL, and a changed model's KL is split over the
answer tokens by role."""

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from palu_lab import damage
from palu_trainer.framework.checkout import CONFIG_DIR


@pytest.fixture(scope="module")
def perturbed_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its last layer's MLP output perturbed."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        weight = model.model.layers[-1].mlp.down_proj.weight
        weight += 0.5 * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    out = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def test_no_damage_against_itself_and_a_changed_model_split_by_role(
    tiny_model_dir, perturbed_model_dir, tofu_dir, tmp_path
):
    out = tmp_path / "damage.json"
    perturbed = perturbed_model_dir
    damage.main(
        ["--reference", str(tiny_model_dir), "--checkpoint", f"same={tiny_model_dir}",
         "--checkpoint", f"perturbed={perturbed}", "--data-dir", str(tofu_dir), "--rows", "6",
         "--model-config", "tiny-llama", "--json", str(out)]
    )  # fmt: skip
    figures = json.loads(out.read_text())
    assert list(figures) == ["same", "perturbed"]
    for name in damage.UTILITY_SETS:
        same, changed = figures["same"][name], figures["perturbed"][name]
        assert same["rows"] == 6
        tokens = {role: part["tokens"] for role, part in same["by_role"].items()}
        # every answer token has one role, and the annotator finds spans in each set's answers
        assert sum(tokens.values()) == same["all_tokens"]["tokens"] and tokens["initiating"] > 0
        assert same["all_tokens"]["mean_kl"] == pytest.approx(0.0, abs=1e-6)
        assert same["mean_absolute_logit_shift"] == pytest.approx(0.0, abs=1e-6)
        assert changed["all_tokens"]["mean_kl"] > 1e-4
        # the mean over all tokens is the token-weighted mean of the roles' means
        weighted = sum(p["mean_kl"] * p["tokens"] for p in changed["by_role"].values() if p["tokens"])
        assert weighted / changed["all_tokens"]["tokens"] == pytest.approx(changed["all_tokens"]["mean_kl"])


def test_a_shift_of_every_logit_is_a_shift_not_a_divergence(tiny_model_dir, tofu_dir, tmp_path):
    """An output bias of 2.5 on every token: the softmax is unchanged, the mean logit moves by 2.5."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.full((head.out_features,), 2.5))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    template_args = yaml.safe_load((CONFIG_DIR / "model" / "tiny-llama.yaml").read_text())["template_args"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = damage.annotated_dataset(
        tofu_dir, "world_facts_perturbed", 5, tokenizer, template_args, tmp_path
    )
    figures = damage.set_damage(model, damage.reference_answers(reference, dataset), dataset)
    assert figures.rows == 5 and figures.all_tokens.tokens > 5
    assert figures.mean_logit_shift == pytest.approx(2.5, abs=1e-4)
    assert figures.mean_absolute_logit_shift == pytest.approx(2.5, abs=1e-4)
    assert figures.all_tokens.mean_kl == pytest.approx(0.0, abs=1e-6)
