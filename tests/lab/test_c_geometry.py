"""palu_lab.c_geometry (issue 59) on tiny Llamas: the two gradients differ exactly along the mean output row,
and how far they differ follows how aligned the output rows are with their mean."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from palu_lab import c_geometry


@pytest.fixture(scope="module")
def aligned_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with one shared direction added to every output row (as in SmolLM2, whose rows have a
    mean cosine of 0.67 with their mean; the random init's have 0.02)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows = model.get_output_embeddings().weight
    with torch.no_grad():
        shared = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(0))
        rows += 3 * rows.norm(dim=-1).mean() * shared / shared.norm()
    out = tmp_path_factory.mktemp("aligned")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)  # its files differ by transformers
    return out


def geometry(model_dir, tofu_dir, tmp_path):
    out = tmp_path / f"{model_dir.name}.json"
    c_geometry.main(
        ["--model", str(model_dir), "--model-config", "tiny-llama", "--tofu-dir", str(tofu_dir),
         "--split", "forget01", "--rows", "6", "--json", str(out)]
    )  # fmt: skip
    return json.loads(out.read_text())


def test_the_gradients_differ_along_the_mean_row_by_how_aligned_the_rows_are(
    tiny_model_dir, aligned_model_dir, tofu_dir, tmp_path
):
    random_init = geometry(tiny_model_dir, tofu_dir, tmp_path)
    aligned = geometry(aligned_model_dir, tofu_dir, tmp_path)
    for figures in (random_init, aligned):
        assert figures["positions"] > 6 and figures["top_k"] == round(0.15625 * figures["vocab_size"])
        # the difference is -(2/K)·Σ_top-K(z_i - c)·w̄: exactly along the mean output row
        assert figures["difference_cosine_with_mean_row"]["low"] == pytest.approx(1.0, abs=1e-9)
        # through c the logit gradient sums to zero at every position; detached it does not
        assert abs(figures["logit_gradient_sum_through_c"]["high"]) < 1e-12
        assert figures["logit_gradient_sum_detached"]["low"] > 0.1
    assert random_init["output_rows_cosine_with_mean_row"] < 0.1
    assert aligned["output_rows_cosine_with_mean_row"] > 0.9
    assert random_init["cosine"]["low"] > 0.95  # unaligned rows: the two forms are nearly the same step
    assert aligned["cosine"]["high"] < 0.5  # aligned rows: the detached step is mostly the shared direction
    assert aligned["detached_norm"]["median"] > 2 * aligned["through_c_norm"]["median"]
