"""StageArchive: what a finished stage leaves in the committed archive, and what comes back from it."""

import json

import pytest

from palu_lab.miniature import config_digest
from palu_lab.stage_archive import StageArchive


def finished_stage(folder, name, logs):
    stage = folder / name
    stage.mkdir(parents=True)
    (stage / "TOFU_EVAL.json").write_text(json.dumps(logs))
    (stage / "model.safetensors").write_bytes(b"weights")
    (stage / "demo_stage.json").write_text(json.dumps({"wall_time_s": 5.0}))
    return stage


def test_a_stage_is_archived_once_without_weights_and_restored_where_missing(tmp_path):
    cache, folder = tmp_path / "cache", tmp_path / "archive"
    logs = {"forget_quality": {"agg_value": 0.25, "value_by_index": {"0": 1}}, "note": "text"}
    stage = finished_stage(cache, "eval-abc", logs)
    archive = StageArchive(folder, cache)
    archive.keep(stage, {"original": "first"})
    archive.keep(stage, {"original": "second"})  # a later session's cached stage keeps its first origin
    kept = folder / "eval-abc"
    names = sorted(path.name for path in kept.iterdir())
    assert names == ["TOFU_EVAL.json", "demo_stage.json", "origin.json"]
    assert json.loads((kept / "TOFU_EVAL.json").read_text()) == {
        "forget_quality": {"agg_value": 0.25},
        "note": {"agg_value": "text"},
    }
    assert json.loads((kept / "origin.json").read_text()) == {"original": "first"}

    (cache / "eval-abc" / "demo_stage.json").unlink()  # a stage the cache holds unfinished is replaced
    finished_stage(cache, "eval-def", logs)  # a finished one is left alone
    (folder / "eval-def").mkdir()  # an archive entry copied halfway (no marker) is not a stage
    assert archive.restore() == 1
    assert json.loads((cache / "eval-abc" / "TOFU_EVAL.json").read_text())["forget_quality"] == {
        "agg_value": 0.25
    }
    assert (cache / "eval-def" / "model.safetensors").is_file()


def test_an_unfinished_stage_is_not_archived(tmp_path):
    stage = tmp_path / "cache" / "unlearn-abc"
    stage.mkdir(parents=True)
    with pytest.raises(ValueError, match="not a finished stage"):
        StageArchive(tmp_path / "archive", tmp_path / "cache").keep(stage, {})
    assert not (tmp_path / "archive").exists()


def test_origins_count_the_unlearning_runs_by_original_and_commit(tmp_path):
    archive = StageArchive(tmp_path / "archive", tmp_path / "cache")
    for name, digest, commit in (
        ("unlearn-a", "x", "c1"),
        ("unlearn-b", "x", "c2"),
        ("unlearn-c", "y", "c2"),
        ("eval-d", "y", "c1"),
    ):
        archive.keep(finished_stage(tmp_path / "cache", name, {}), {"original": digest, "commit": commit})
    assert archive.origins() == {"x": 2, "y": 1}
    assert archive.origins("commit") == {"c1": 1, "c2": 2}


def test_the_config_digest_changes_with_what_the_configs_set_not_with_how_they_are_written(tmp_path):
    """The unlearning stages' key: a comment, a Hydra callback or a package header that moves nothing keeps
    every archived run; a changed value runs them again."""
    configs = tmp_path / "configs"
    (configs / "peft").mkdir(parents=True)
    (configs / "experiment").mkdir()
    lora, experiment = configs / "peft" / "lora.yaml", configs / "experiment" / "palu.yaml"
    lora.write_text("# @package peft\nr: 16\n")
    experiment.write_text("# @package _global_\ntrainer:\n  method_args:\n    kl_weight: 1.0\n")
    written = config_digest(configs)

    lora.write_text("# @package _global_\n# adapters\npeft:\n  r: 16\nhydra:\n  callbacks:\n    plugin: {}\n")
    experiment.write_text(experiment.read_text() + "# checks\nhydra:\n  callbacks:\n    plugin: {}\n")
    assert config_digest(configs) == written

    experiment.write_text(experiment.read_text().replace("kl_weight: 1.0", "kl_weight: 2.0"))
    assert config_digest(configs) != written
    (configs / "peft" / "lora.yaml").unlink()
    experiment.write_text(experiment.read_text().replace("kl_weight: 2.0", "kl_weight: 1.0"))
    assert config_digest(configs) != written
