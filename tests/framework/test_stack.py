"""The plugin on both tested framework stacks (docs/setup.md): the Trainer's keywords of transformers 4.51,
install ranges that never move the framework's pins, a refused combination named with its fix, and the
loss divided by the accumulation steps on both."""

import configparser
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from packaging.version import Version

from palu_trainer.framework import stack
from palu_trainer.framework.checkout import checkout_dir
from palu_trainer.framework.trainers.palu import PALUTrainer
from palu_trainer.framework.trainers.tpo import TPOTrainer

from .test_plugin import unloaded_model

ROOT = Path(__file__).resolve().parents[2]
# What each tested framework commit's requirements.txt pins, of the libraries the plugin also requires.
TESTED_PINS = {
    "d3d7cf9": {"transformers": "4.45.1", "datasets": "3.0.1", "accelerate": "0.34.2", "hydra-core": "1.3"},
    "4ad738a": {"transformers": "4.51.3", "datasets": "3.0.1", "accelerate": "0.34.2", "hydra-core": "1.3"},
    "c3301d8": {"transformers": "5.5.4", "datasets": "3.0.1", "accelerate": "1.13.0", "hydra-core": "1.3"},
}
# What those pins bring with them (transformers 4.45.1 takes tokenizers 0.20, 4.51.3 0.21, 5.5.4 0.22).
RESOLVED_WITH_THEM = {"tokenizers": ["0.20.3", "0.21.1", "0.22.2"], "deepspeed": ["0.15.4"]}
pytestmark = pytest.mark.stack


def install_requires() -> dict[str, Requirement]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in config["options"]["install_requires"].splitlines()]
    requirements = [Requirement(line) for line in lines if line and not line.startswith("#")]
    return {requirement.name: requirement for requirement in requirements}


@pytest.mark.parametrize("commit", list(TESTED_PINS))
def test_install_ranges_hold_every_tested_framework_pin(commit):
    """Installing the plugin into a framework environment never moves what the framework pinned."""
    requires = install_requires()
    for name, version in {**TESTED_PINS[commit]}.items():
        assert version in requires[name].specifier, f"{name}=={version} ({commit}) outside {requires[name]}"
    for name, versions in RESOLVED_WITH_THEM.items():
        assert all(version in requires[name].specifier for version in versions), (name, requires[name])


def test_the_installed_stack_is_one_the_checkout_runs():
    assert stack.stack_problem(checkout_dir() / "src") is None
    pin = stack.framework_transformers_pin(checkout_dir() / "src")
    assert pin == transformers.__version__, "make setup installs the framework's own transformers"


@pytest.mark.parametrize("method", ["PALU", "TPO"])
def test_a_step_through_the_installed_trainer(make_trainer, method):
    """transformers 4.51's training loop calls compute_loss(..., num_items_in_batch=) and log(logs, start)."""
    trainer_class = {"PALU": PALUTrainer, "TPO": TPOTrainer}[method]
    method_args = {"top_k": 64} if method == "PALU" else {}
    trainer = make_trainer(max_steps=2, trainer_class=trainer_class, **method_args)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [1, 2]
    assert all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logged)
    if method == "PALU":
        assert all(entry["local_loss"] > 0 for entry in logged)


def accumulation_factor(trainer) -> float:
    """What one micro-batch's gradient under `trainer.training_step` is, as a multiple of its loss's gradient
    (1/2 with 2 accumulation steps when the loss is averaged over the micro-batches); asserted to be one
    factor for every parameter."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in (0, 1)])
    model = trainer.model
    model.zero_grad()
    trainer.compute_loss(model, batch).backward()
    full = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    step_keywords = inspect.signature(trainer.training_step).parameters
    # what the training loop passes for the framework's batches, which hold no top-level labels to count
    extra = {"num_items_in_batch": None} if "num_items_in_batch" in step_keywords else {}
    trainer.current_gradient_accumulation_steps = (
        trainer.args.gradient_accumulation_steps
    )  # set by train() on 5.x
    trainer.training_step(model, batch, **extra)
    step = {name: p.grad.clone() for name, p in model.named_parameters()}
    squared_norm = sum(float(full[n].pow(2).sum()) for n in full)
    factor = sum(float((step[n] * full[n]).sum()) for n in full) / squared_norm
    for name in full:
        torch.testing.assert_close(step[name], full[name] * factor, rtol=1e-5, atol=1e-8, msg=name)
    print(f"{type(trainer).__name__}: loss gradient norm {squared_norm**0.5:.4f}, factor {factor:.4f}")
    return factor


@pytest.mark.parametrize("method", ["PALU", "TPO"])
def test_accumulated_micro_batches_are_averaged(make_trainer, method):
    """With 2 accumulation steps, one micro-batch's gradient is half its loss's gradient on both stacks
    (transformers 4.51 skips the division for models whose forward takes **kwargs)."""
    trainer_class = {"PALU": PALUTrainer, "TPO": TPOTrainer}[method]
    method_args = {"top_k": 64, "reference_cache": False} if method == "PALU" else {}
    trainer = make_trainer(trainer_class=trainer_class, gradient_accumulation_steps=2, **method_args)
    assert accumulation_factor(trainer) == pytest.approx(0.5, rel=1e-5)


def test_the_frameworks_stock_trainer_sums_accumulated_micro_batches_on_4_51(make_trainer):
    """The upstream report in docs/setup.md ("Gradient accumulation on upstream main"): the framework's own
    GradAscent, unpatched, with 2 accumulation steps, on a Llama (whose forward takes **kwargs). On
    transformers 4.45 each micro-batch counts half; on 4.51 (upstream main 4ad738a) it counts whole, so the
    gradient grows with the accumulation steps; on 5.5.4 (PR #191) it counts half again, as 5.x divides
    whenever the loop counted no labels. The guarded trainer of palu-train and the plugin's experiments
    halves it on each."""
    from palu_trainer.framework.checkout import ensure_importable
    from palu_trainer.framework.trainers.guarded import GuardedTrainer

    ensure_importable()
    from trainer.unlearn.grad_ascent import GradAscent

    trainer = make_trainer(trainer_class=GradAscent, gradient_accumulation_steps=2)
    summed = Version("4.46") <= Version(transformers.__version__) < Version("5")
    assert getattr(trainer, "model_accepts_loss_kwargs", False) == (
        Version(transformers.__version__) >= Version("4.46")
    )
    assert accumulation_factor(trainer) == pytest.approx(1.0 if summed else 0.5, rel=1e-5)
    guarded = make_trainer(
        trainer_class=type("GradAscent", (GuardedTrainer, GradAscent), {}), gradient_accumulation_steps=2
    )
    assert accumulation_factor(guarded) == pytest.approx(0.5, rel=1e-5)


def fake_framework(tmp_path, passes_processing_class: bool, pin: str) -> Path:
    src = tmp_path / "open-unlearning" / "src"
    (src / "trainer").mkdir(parents=True)
    keyword = "processing_class=processing_class" if passes_processing_class else "tokenizer=tokenizer"
    (src / "trainer" / "__init__.py").write_text(f"trainer_cls(model=model, {keyword}, args=args)\n")
    (src.parent / "requirements.txt").write_text(f"torch==2.4.1\ntransformers=={pin}\n")
    return src


def test_processing_class_on_an_older_transformers_is_named_with_both_versions(tmp_path, monkeypatch):
    src = fake_framework(tmp_path, passes_processing_class=True, pin="4.51.3")
    monkeypatch.setattr(stack, "trainer_takes_processing_class", lambda: False)
    monkeypatch.setattr(stack.transformers, "__version__", "4.45.1")
    problem = stack.stack_problem(src)
    assert "passes processing_class= to the Trainer (its transformers 4.51.3)" in problem
    assert "which transformers 4.45.1 does not have (added in 4.46)" in problem
    assert "pip install 'transformers==4.51.3'" in problem and "d3d7cf9 runs on 4.45.1" in problem
    assert stack.stack_problem(fake_framework(tmp_path / "old", False, "4.45.1")) is None


def test_transformers_5_is_refused_only_under_a_framework_that_pins_4(tmp_path, monkeypatch):
    src = fake_framework(tmp_path, passes_processing_class=True, pin="4.51.3")
    monkeypatch.setattr(stack.transformers, "__version__", "5.24.0")
    problem = stack.stack_problem(src)
    assert "transformers 5.24.0 is installed" in problem and "(transformers 4.51.3)" in problem
    assert (
        "does not import on transformers 5.x" in problem and "pip install 'transformers==4.51.3'" in problem
    )
    assert "its PR #191, c3301d8" in problem
    monkeypatch.setattr(stack, "trainer_takes_processing_class", lambda: True)
    assert stack.stack_problem(fake_framework(tmp_path / "pr191", True, "5.5.4")) is None


@pytest.mark.skipif(
    stack.trainer_takes_processing_class(), reason="the refused combination needs a transformers before 4.46"
)
def test_palu_train_stops_on_the_combination_before_a_type_error(tmp_path):
    """The framework after PR #175 on transformers 4.45: both versions named, exit 1, no TypeError."""
    checkout = tmp_path / "open-unlearning"
    subprocess.run(["cp", "-r", str(checkout_dir()), str(checkout)], check=True)
    init = checkout / "src" / "trainer" / "__init__.py"
    init.write_text(init.read_text().replace("tokenizer=tokenizer", "processing_class=processing_class"))
    requirements = checkout / "requirements.txt"
    requirements.write_text(requirements.read_text().replace("transformers==4.45.1", "transformers==4.51.3"))
    result = subprocess.run(
        [
            *(str(Path(sys.executable).parent / "palu-train"), "--config-name=unlearn.yaml", "+runtime=cpu"),
            *unloaded_model(tmp_path / "model"),
        ],
        env={"PATH": "/usr/bin:/bin", "OPEN_UNLEARNING_DIR": str(checkout), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "TypeError" not in result.stderr
    assert "which transformers 4.45.1 does not have" in result.stderr
    assert "pip install 'transformers==4.51.3'" in result.stderr


def test_a_stock_trainer_without_num_items_is_named_before_a_type_error(monkeypatch):
    """The framework at d3d7cf9 (stock NPO's compute_loss(model, inputs, return_outputs=False)) on
    transformers 4.46 or later: refused with both versions, where PALU and TPO take the keyword."""

    class BeforePR175:
        def compute_loss(self, model, inputs, return_outputs=False):
            return 0

    monkeypatch.setattr(stack, "training_loop_passes_num_items", lambda: True)
    src = checkout_dir() / "src"
    problem = stack.compute_loss_problem(BeforePR175, src)
    pin = stack.framework_transformers_pin(src)
    installed = transformers.__version__
    assert f"BeforePR175.compute_loss takes no num_items_in_batch, which transformers {installed}" in problem
    assert f"pins transformers {pin}: install that (pip install 'transformers=={pin}')" in problem
    assert stack.compute_loss_problem(PALUTrainer, src) is None
    assert stack.compute_loss_problem(TPOTrainer, src) is None
    from trainer.unlearn.npo import NPO  # the framework's own, at this stack's commit

    after_pr175 = pin != TESTED_PINS["d3d7cf9"]["transformers"]
    assert (stack.compute_loss_problem(NPO, src) is None) == after_pr175
