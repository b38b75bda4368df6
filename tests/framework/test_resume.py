"""Resuming: an interrupted run continues to the weights of an uninterrupted one, through train.py's call."""

import json
import os

import numpy
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from palu_lab.trainer_config import tokenizer_keyword
from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.framework.lora import LoraSettings, add_adapters
from palu_trainer.framework.patches import resuming
from palu_trainer.framework.patches.adapters import training_with_adapters
from palu_trainer.training.resume import checkpoint_to_resume
from palu_trainer.training.run_folder import remove_stale_weights

from ..conftest import TAG_TEMPLATE
from .test_datasets import span_dataset

ensure_importable()
from data.unlearn import ForgetRetainDataset  # noqa: E402
from trainer import load_trainer  # noqa: E402

from palu_trainer.framework.datasets import DataCollatorWithTokenRoles  # noqa: E402

# 3 forget rows in batches of 2: 2 steps per epoch, checkpoint-2 at the end of epoch 1. From a checkpoint in
# the middle of an epoch the first resumed batch draws other retain rows: the framework draws them with the
# global RNG in __getitem__, and transformers restores the checkpoint's RNG only after fetching that batch.
STEPS, SAVE_EVERY = 4, 2


class CountSteps(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


class Interrupt(TrainerCallback):
    """Ctrl-C during the step after a checkpoint."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == SAVE_EVERY + 1:
            raise KeyboardInterrupt


@pytest.fixture
def palu_run(tmp_path, tiny_model_dir):
    """A PALU trainer built by the framework's load_trainer, as train.py builds it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def build(output_dir, checkpoint=None, callbacks=(), lora=False, **method_args):
        forget = span_dataset(tmp_path, tokenizer, TAG_TEMPLATE)
        retain = span_dataset(tmp_path, tokenizer, TAG_TEMPLATE)
        trainer_cfg = OmegaConf.create(
            {
                "handler": "PALUTrainer",
                "method_args": {"top_k": 64, **method_args},
                "args": {
                    "output_dir": str(output_dir),
                    "max_steps": STEPS,
                    "per_device_train_batch_size": 2,
                    "learning_rate": 1e-2,
                    "lr_scheduler_type": "linear",
                    "save_strategy": "steps",
                    "save_steps": SAVE_EVERY,
                    "save_only_model": False,
                    "logging_steps": 1,
                    "report_to": "none",
                    "use_cpu": True,
                    "remove_unused_columns": False,
                    "seed": 0,
                    "do_train": True,  # as the framework's finetune.yaml
                },
            }
        )
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        if lora:
            model = add_adapters(model, LoraSettings(r=4))
        framework_load_trainer = training_with_adapters(load_trainer) if lora else load_trainer
        trainer, _ = resuming(framework_load_trainer, checkpoint)(
            trainer_cfg=trainer_cfg,
            model=model,
            train_dataset=ForgetRetainDataset(forget=forget, retain=retain),
            **tokenizer_keyword(tokenizer),
            data_collator=DataCollatorWithTokenRoles(tokenizer, index="index"),
            template_args=TAG_TEMPLATE,
        )
        for callback in callbacks:
            trainer.add_callback(callback)
        return trainer

    return build


@pytest.mark.parametrize("lora", [False, True], ids=["full", "LoRA"])
@pytest.mark.parametrize("reference_cache", [True, False])
def test_interrupted_run_resumes_to_the_uninterrupted_weights(tmp_path, palu_run, reference_cache, lora):
    register()
    torch.manual_seed(0)
    uninterrupted = palu_run(tmp_path / "full", reference_cache=reference_cache, lora=lora)
    uninterrupted.train()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.safetensors").write_bytes(b"an earlier run's final model")
    torch.manual_seed(0)
    interrupted = palu_run(
        tmp_path / "run", reference_cache=reference_cache, lora=lora, callbacks=[Interrupt()]
    )
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == [f"checkpoint-{SAVE_EVERY}"]
    checkpoint = checkpoint_to_resume(True, str(tmp_path / "run"))
    assert checkpoint.endswith(f"checkpoint-{SAVE_EVERY}")
    torch.manual_seed(1)  # resuming restores the checkpoint's RNG state, whatever the process did before
    trained = CountSteps()
    resumed = palu_run(
        tmp_path / "run", checkpoint, reference_cache=reference_cache, lora=lora, callbacks=[trained]
    )
    resumed.train()  # as train.py calls it: no arguments
    assert trained.steps == list(range(SAVE_EVERY + 1, STEPS + 1))
    steps = [entry["step"] for entry in resumed.state.log_history if "local_loss" in entry]
    assert steps == list(range(1, STEPS + 1))  # 1-3 from the checkpoint, 4-6 trained after resuming
    full = dict(uninterrupted.model.named_parameters())
    trained_names = [name for name, parameter in resumed.model.named_parameters() if parameter.requires_grad]
    assert trained_names and all(("lora_" in name) == lora for name in trained_names)
    for name, parameter in resumed.model.named_parameters():
        torch.testing.assert_close(parameter, full[name], rtol=1e-5, atol=1e-6, msg=name)
    assert [e.get("kl_loss") for e in resumed.state.log_history if "kl_loss" in e] == [
        e.get("kl_loss") for e in uninterrupted.state.log_history if "kl_loss" in e
    ]


def register():
    from palu_trainer.framework.registry import register as register_palu

    register_palu()


def test_checkpoints_that_cannot_resume_are_refused(tmp_path):
    assert checkpoint_to_resume(None, str(tmp_path)) is None
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint=true: no checkpoint-N folder in"):
        checkpoint_to_resume(True, str(tmp_path))
    model_only = tmp_path / "checkpoint-2"
    model_only.mkdir()
    with pytest.raises(FileNotFoundError, match="not a Trainer checkpoint"):
        checkpoint_to_resume(str(model_only), str(tmp_path))
    (model_only / "trainer_state.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, model_only / "model.safetensors")
    with pytest.raises(ValueError, match=r"holds no optimizer state .*trainer\.args\.save_only_model=false"):
        checkpoint_to_resume(str(model_only), str(tmp_path))
    torch.save({"state": {}}, model_only / "optimizer.pt")
    assert checkpoint_to_resume("true", str(tmp_path)) == str(model_only)


class Payload:
    """Unpickled, it runs a shell command: what a crafted checkpoint file could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_file_holding_a_pickle_payload_is_refused_before_anything_loads_it(tmp_path):
    marker = tmp_path / "payload-ran"
    folder = tmp_path / "checkpoint-2"
    (folder / "global_step2").mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    # what real checkpoints hold besides tensors passes: numpy's RNG state, DeepSpeed's ZeRO stage and scaler
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.save({"numpy": numpy.random.get_state()}, folder / "rng_state_0.pth")
    optimizer_state = {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0)}
    torch.save(optimizer_state, folder / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert checkpoint_to_resume(str(folder), str(tmp_path)) == str(folder)
    torch.save({"state": {}, "param_groups": [Payload(marker)]}, folder / "optimizer.pt")
    with pytest.raises(FileNotFoundError, match=r"optimizer\.pt names posix\.system, which no checkpoint"):
        checkpoint_to_resume(str(folder), str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint .*posix\.system"):
        checkpoint_to_resume("true", str(tmp_path))
    assert not marker.exists()


def test_resume_true_skips_a_half_written_or_damaged_checkpoint_and_says_so(tmp_path):
    def checkpoint(step):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        save_file({"w": torch.zeros(64)}, folder / "model.safetensors")
        torch.save({"state": {}}, folder / "optimizer.pt")
        return folder

    complete, damaged, half = checkpoint(2), checkpoint(4), checkpoint(6)
    (half / "trainer_state.json").unlink()
    weights = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    reports = []
    assert checkpoint_to_resume("true", str(tmp_path), reports.append) == str(complete)
    assert reports[0].startswith(
        "resume_from_checkpoint=true: skipped checkpoint-6: not a Trainer checkpoint"
    )
    assert reports[1].startswith(
        "resume_from_checkpoint=true: skipped checkpoint-4: model.safetensors is damaged"
    )
    assert reports[1].endswith(f"resuming from {complete}")
    with pytest.raises(FileNotFoundError) as named:
        checkpoint_to_resume(str(damaged), str(tmp_path))
    assert str(named.value).startswith(f"resume_from_checkpoint={damaged}: model.safetensors is damaged (")
    assert str(named.value).endswith(f"the newest complete checkpoint is {complete}")
    torch.save({"state": {}}, complete / "optimizer.pt")
    (complete / "optimizer.pt").write_bytes((complete / "optimizer.pt").read_bytes()[:-30])
    with pytest.raises(
        FileNotFoundError, match="no complete checkpoint in .*checkpoint-2: optimizer.pt is damaged"
    ):
        checkpoint_to_resume("true", str(tmp_path))


def test_an_earlier_runs_final_weights_are_removed_before_training(tmp_path):
    for name in ("model.safetensors", "model-00001-of-00002.safetensors", "config.json"):
        (tmp_path / name).write_text("")
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "model.safetensors").write_text("")
    assert remove_stale_weights(str(tmp_path)) == ["model-00001-of-00002.safetensors", "model.safetensors"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint-3", "config.json"]
