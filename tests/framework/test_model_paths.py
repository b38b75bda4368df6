"""Model and tokenizer paths, checked before palu-train imports torch (end to end, with the import check:
test_framework_entry_point.py::test_the_fifth_sweeps_refusals_through_both_entry_points)."""

import pytest
from huggingface_hub import constants
from omegaconf import OmegaConf

from palu_trainer.framework.model_paths import command_line_model_problem, model_problems

KEY = "model.model_args.pretrained_model_name_or_path"


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_configs_hub_id_offline_and_not_cached_is_named(offline, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    cfg = OmegaConf.create({"model": {"model_args": {"pretrained_model_name_or_path": "owner/model"}}})
    assert model_problems(cfg, "train").startswith(f"{KEY}=owner/model is not a local folder, not in the")
    cached = tmp_path / "models--owner--model" / "snapshots" / "abc"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    (tmp_path / "models--owner--model" / "refs").mkdir()
    (tmp_path / "models--owner--model" / "refs" / "main").write_text("abc")
    assert model_problems(cfg, "train") is None  # in the cache: loads offline


@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_the_command_lines_paths_are_checked_without_the_config(offline, tmp_path, prefix):
    typo = tmp_path / "no-such-model"
    assert command_line_model_problem([f"{prefix}{KEY}={typo}"], "train") == (
        f"{KEY}={typo}: no such folder; give a saved model folder or a hub id"
    )
    tokenizer = "model.tokenizer_args.pretrained_model_name_or_path=a/b/c"
    assert "(a hub id is owner/name)" in command_line_model_problem(["trainer=NPO", tokenizer], "train")


def test_what_the_command_line_leaves_to_the_composed_config_passes_here(offline):
    interpolated = f"{KEY}=${{paths.root}}/model"  # resolved once Hydra composes
    assert command_line_model_problem([interpolated, "model=tiny-llama", f"{KEY}x=/nothing"], "train") is None
