import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from palu_lab.trainer_config import trainer_config
from palu_trainer.benchmarks.hf_dir import read_configs
from palu_trainer.framework.checkout import checkout_dir
from palu_trainer.framework.local_mirrors import (
    caching_local_folders_by_content,
    dataset_loads,
    redirect_to_local_mirrors,
)
from palu_trainer.framework.registry import register

from ..conftest import make_tofu_mirror, write_jsonl


def compose_unlearn(overrides):
    register()
    with initialize_config_dir(config_dir=str(checkout_dir() / "configs"), version_base=None):
        return compose(config_name="unlearn.yaml", overrides=overrides, return_hydra_config=False)


@pytest.mark.parametrize(
    ("trainer", "overrides"), [("PALU", ["trainer.method_args.top_k=all"]), ("SimNPO", []), ("TPO", [])]
)
def test_a_trainers_config_is_its_node_in_the_whole_composition(trainer, overrides):
    """trainer_config leaves out the groups the trainer node does not read; the node is the same, resolved."""
    whole = compose_unlearn([f"trainer={trainer}", "task_name=config", *overrides]).trainer
    light = trainer_config(trainer, overrides)
    assert OmegaConf.to_container(light, resolve=True) == OmegaConf.to_container(whole, resolve=True)
    assert light.args.remove_unused_columns is False  # unlearn.yaml's own setting, on every trainer


def test_palu_configs_are_found_through_the_search_path():
    cfg = compose_unlearn(["experiment=unlearn/tofu/palu", "forget_split=forget05", "task_name=t"])
    assert cfg.trainer.handler == "PALUTrainer"
    assert cfg.trainer.method_args.top_k == 0.15625 and "num_initiating_tokens" not in cfg.trainer.method_args
    forget = cfg.data.forget.TOFU_QA_forget_spans
    assert forget.handler == "QAwithSpansDataset"
    policy = ("num_initiating_tokens", "initiating_strategy", "initiating_ratio", "merge_adjacent_spans")
    assert [forget.args[key] for key in policy] == [None, "first_n", None, False]  # unset: N=3, p=0.5
    override = compose_unlearn(
        [
            "experiment=unlearn/tofu/palu",
            "num_initiating_tokens=2",
            "initiating_strategy=random_n",
            "task_name=t",
        ]
    )
    args = override.data.forget.TOFU_QA_forget_spans.args
    assert (args.num_initiating_tokens, args.initiating_strategy) == (2, "random_n")
    assert forget.args.span_annotations.endswith("span_annotations/tofu_forget05.jsonl")
    assert cfg.collator.DataCollatorWithTokenRoles.handler == "DataCollatorWithTokenRoles"


def test_release_preset_sets_the_released_form_and_merges_spans_in_the_dataset():
    cfg = compose_unlearn(["experiment=unlearn/tofu/palu", "trainer=PALU_release", "task_name=t"])
    method_args = cfg.trainer.method_args
    assert cfg.trainer.handler == "PALUTrainer"
    assert (method_args.target_gradient, method_args.kl_direction, method_args.kl_weight) == (
        True,
        "policy_to_ref",
        "alpha",
    )
    assert (method_args.top_k, method_args.target) == (0.15625, "global_mean")
    assert cfg.data.forget.TOFU_QA_forget_spans.args.merge_adjacent_spans is True


def test_cpu_overlay_sets_what_the_framework_needs_on_cpu():
    cfg = compose_unlearn(["experiment=unlearn/tofu/default", "trainer=NPO", "+runtime=cpu", "task_name=t"])
    args = cfg.trainer.args
    assert (args.optim, args.bf16, args.warmup_epochs, args.warmup_ratio) == ("adamw_torch", False, 0, 0.1)
    assert cfg.model.model_args.device_map == "cpu"
    assert cfg.trainer.handler == "NPO"


def test_every_tofu_load_is_found(tofu_dir):
    cfg = compose_unlearn(["experiment=unlearn/tofu/palu", "task_name=t"])
    loads = dict(dataset_loads(cfg))
    assert "data.forget.TOFU_QA_forget_spans.args.hf_args" in loads
    assert "eval.tofu.metrics.forget_Q_A_ROUGE.datasets.TOFU_QA_forget.args.hf_args" in loads
    assert sum(1 for hf_args in loads.values() if hf_args.path == "locuslab/TOFU") >= 10


def test_wrong_mirror_names_the_missing_config(tofu_dir):
    cfg = compose_unlearn(["experiment=unlearn/tofu/palu", "forget_split=forget01", "task_name=t"])
    with pytest.raises(FileNotFoundError, match=r"has no dataset config 'holdout10', needed by eval\.tofu"):
        redirect_to_local_mirrors(cfg, {"TOFU_DIR": str(tofu_dir)})
    with pytest.raises(FileNotFoundError, match=r"TOFU_DIR=.*no-such-dir: no such folder; point TOFU_DIR at"):
        redirect_to_local_mirrors(cfg, {"TOFU_DIR": str(tofu_dir / "no-such-dir")})


def test_mirror_redirects_training_and_eval_loads(tmp_path, tofu_dir):
    readme = (tofu_dir / "README.md").read_text()
    header = yaml.safe_load(readme.split("---")[1])
    header["configs"].append({"config_name": "holdout01", "data_files": "holdout01.json"})
    (tmp_path / "README.md").write_text("---\n" + yaml.safe_dump(header) + "---\n")
    for source in tofu_dir.glob("*.json"):  # the redirect checks that each listed file is there
        (tmp_path / source.name).symlink_to(source)
    (tmp_path / "holdout01.json").symlink_to(tofu_dir / "forget01.json")
    assert "holdout01" in read_configs(tmp_path) and "forget01" in read_configs(tmp_path)
    cfg = compose_unlearn(
        ["experiment=unlearn/tofu/palu", "forget_split=forget01", "holdout_split=holdout01", "task_name=t"]
    )
    changed = redirect_to_local_mirrors(cfg, {"TOFU_DIR": str(tmp_path)})
    assert any(line.startswith("data.forget.") for line in changed)
    assert any(line.startswith("data.retain.") for line in changed)
    assert any(line.startswith("eval.tofu.metrics.privleak") and "holdout01" in line for line in changed)
    remaining = [hf.path for _, hf in dataset_loads(cfg) if hf.path == "locuslab/TOFU"]
    assert remaining == []
    assert OmegaConf.select(cfg, "data.retain.TOFU_QA_retain.args.hf_args.path") == str(tmp_path)


def forget01_questions(composed, mirror: Path, given_as: str) -> list[str]:
    """The forget rows a run would load from the folder `mirror` `given_as` TOFU_DIR (palu-train's redirect)
    or as the datasets' path on the command line (the patched get_data, under either entry point), then the
    framework's loader."""
    from data.utils import load_hf_dataset  # importable once compose_unlearn has registered PALU

    cfg = copy.deepcopy(composed)
    if given_as == "TOFU_DIR":
        redirect_to_local_mirrors(cfg, {"TOFU_DIR": str(mirror)})
    else:
        cfg.data.forget.TOFU_QA_forget.args.hf_args.path = str(mirror)
        assert caching_local_folders_by_content(cfg.data) == ["forget.TOFU_QA_forget.args.hf_args"]
    hf_args = OmegaConf.to_container(cfg.data.forget.TOFU_QA_forget.args.hf_args, resolve=True)
    return load_hf_dataset(**hf_args)["question"]


@pytest.mark.parametrize("given_as", ["TOFU_DIR", "path"])
def test_each_mirror_serves_its_current_files(tmp_path, tofu_dir, given_as):
    """`datasets` alone keys a local folder's cache by its base name and config: the second folder named
    tofu, or the first one edited, would come from the first one's cache."""

    def mirror(parent, questions):
        rows = {"forget01": [{"question": q, "answer": "a"} for q in questions]}
        rows["holdout10"] = rows["forget01"]
        return make_tofu_mirror(tmp_path / parent / "tofu", tofu_dir, rows)

    cfg = compose_unlearn(["experiment=unlearn/tofu/default", "forget_split=forget01", "task_name=t"])
    first, second = mirror("a", ["a1", "a2"]), mirror("b", ["b1"])  # same folder name: tofu
    assert forget01_questions(cfg, first, given_as) == ["a1", "a2"]
    assert forget01_questions(cfg, second, given_as) == ["b1"]
    write_jsonl(first / "forget01.json", [{"question": q, "answer": "a"} for q in ("a1", "a2", "a3")])
    assert forget01_questions(cfg, first, given_as) == ["a1", "a2", "a3"]
    assert forget01_questions(cfg, second, given_as) == ["b1"]


def run_entry_point(*argv, timeout=120):
    command = [str(Path(sys.executable).parent / "palu-train"), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def unloaded_model(folder: Path) -> list[str]:
    """Overrides naming `folder`, made to pass for a saved model, for a run that stops before loading one:
    the config's hub id, offline, would stop it first."""
    folder.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    keys = (f"model.{part}.pretrained_model_name_or_path" for part in ("model_args", "tokenizer_args"))
    return [f"{key}={folder}" for key in keys]


@pytest.mark.slow
def test_help_is_a_short_usage_and_hydras_stays_reachable():
    result = run_entry_point("--help")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert len(lines) < 30, len(lines)
    for option in (
        "experiment=unlearn/tofu/palu",
        "span_annotations=",
        "min_initiating_tokens",
        "TOFU_DIR=",
        "+runtime=cpu",
    ):
        assert option in result.stdout, option
    full = run_entry_point("--help-full")
    assert full.returncode == 0 and "Powered by Hydra" in full.stdout and len(full.stdout.splitlines()) > 100


# palu-train with every composition of the config counted (printed at exit)
COUNTING_COMPOSITIONS = """
import atexit, sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl
load = ConfigLoaderImpl.load_configuration
calls = []
ConfigLoaderImpl.load_configuration = lambda *args, **kwargs: calls.append(1) or load(*args, **kwargs)
atexit.register(lambda: print(f"compositions: {len(calls)}", file=sys.stderr))
sys.argv[0] = "palu-train"
from palu_trainer.framework.cli import train_main
train_main()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for machines without CUDA")
@pytest.mark.slow
def test_a_cpu_run_without_the_cpu_overlay_stops_before_loading(tmp_path):
    """The check runs in the job, on Hydra's run config; Hydra's mode probe and its run both take the
    precheck's config: one composition of the config, not three."""
    command = [sys.executable, "-c", COUNTING_COMPOSITIONS, "--config-name=unlearn.yaml"]
    command += ["experiment=unlearn/tofu/palu", f"paths.output_dir={tmp_path}", "task_name=t"]
    command += unloaded_model(tmp_path / "model")
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "palu-train: no CUDA device: add `+runtime=cpu` to the command line" in result.stderr
    assert "division by zero" not in result.stderr
    assert "compositions: 1" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="+runtime=cpu")
@pytest.mark.slow
def test_resuming_from_a_model_only_checkpoint_stops_before_loading(tmp_path):
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    (checkpoint / "model.safetensors").write_text("")
    result = run_entry_point(
        "--config-name=unlearn.yaml",
        "experiment=unlearn/tofu/default",
        "trainer=NPO",
        "+runtime=cpu",
        f"paths.output_dir={tmp_path}",
        f"+trainer.args.resume_from_checkpoint={checkpoint}",
        "task_name=t",
        *unloaded_model(tmp_path / "model"),
    )
    assert result.returncode == 1
    assert f"resume_from_checkpoint={checkpoint} holds no optimizer state" in result.stderr


def test_muse_palu_experiment_reads_raw_text_with_spans_and_the_stock_muse_eval():
    cfg = compose_unlearn(["experiment=unlearn/muse/palu", "task_name=t"])
    forget = cfg.data.forget.MUSE_forget_spans
    assert forget.handler == "PretrainingWithSpansDataset" and forget.args.text_key == "text"
    assert forget.args.span_annotations.endswith("span_annotations/muse_news_forget.jsonl")
    assert forget.args.hf_args.path == "muse-bench/MUSE-News" and forget.args.hf_args.split == "forget"
    assert cfg.data.retain.MUSE_retain.args.hf_args.split == "retain1"
    assert cfg.trainer.handler == "PALUTrainer" and cfg.eval.muse.handler == "MUSEEvaluator"
    assert cfg.collator.DataCollatorWithTokenRoles.handler == "DataCollatorWithTokenRoles"


def test_muse_dir_redirects_muse_news_loads_and_names_a_missing_split(muse_news_dir, tmp_path):
    cfg = compose_unlearn(["experiment=unlearn/muse/palu", "task_name=t"])
    # The local copy lacks raw/retain1: the run stops before loading anything, naming it.
    with pytest.raises(
        FileNotFoundError, match=r"no dataset config 'raw' with split 'retain1', needed by data\.retain"
    ):
        redirect_to_local_mirrors(cfg, {"MUSE_DIR": str(muse_news_dir)})
    retain_from_privleak = compose_unlearn(
        [
            "experiment=unlearn/muse/palu",
            "task_name=t",
            "retain_split=retain",
            "data.retain.MUSE_retain.args.hf_args.name=privleak",
        ]
    )
    changed = redirect_to_local_mirrors(retain_from_privleak, {"MUSE_DIR": str(muse_news_dir)})
    assert any(line.startswith("data.forget.MUSE_forget_spans") for line in changed)
    assert any("forget_knowmem_ROUGE" in line and "few_shot_dataset_hf_args" in line for line in changed)
    assert [hf.path for _, hf in dataset_loads(retain_from_privleak) if "muse-bench" in str(hf.path)] == []


@pytest.mark.parametrize(
    "benchmark, method, trainer",
    [("tofu", "npo", "NPO"), ("tofu", "graddiff", "GradDiff"), ("muse", "simnpo", "SimNPO")],
)
def test_the_plugins_stock_experiments_are_the_frameworks_with_its_callback(benchmark, method, trainer):
    ours = compose_unlearn([f"experiment=unlearn/{benchmark}/{method}", "task_name=t"])
    frameworks = compose_unlearn(
        [f"experiment=unlearn/{benchmark}/default", f"trainer={trainer}", "task_name=t"]
    )
    assert ours.trainer.handler == trainer
    assert OmegaConf.to_container(ours) == OmegaConf.to_container(frameworks)
    with initialize_config_dir(config_dir=str(checkout_dir() / "configs"), version_base=None):
        hydra = compose(
            "unlearn.yaml", [f"experiment=unlearn/{benchmark}/{method}", "task_name=t"], True
        ).hydra
    assert hydra.callbacks.palu_trainer._target_.endswith("FrameworkScript")
