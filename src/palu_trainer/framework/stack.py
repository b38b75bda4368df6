"""The framework-and-transformers stack this process runs on, detected, never pinned: each difference between
the tested stacks (docs/setup.md) is read off the installed code, so a newer release that keeps an interface
keeps working, and a combination that cannot work is named with its fix before anything loads."""

import inspect
import re
from pathlib import Path

import transformers
from packaging.version import Version

# A framework commit that pins transformers 4.x imports names that 5.x removed (AutoModelForVision2Seq in
# train.py and its stock trainers); its PR #191 pins 5.5.4 and imports on it.
MAJOR_WITHOUT_4X_NAMES = 5


def trainer_takes_processing_class() -> bool:
    """Whether `transformers.Trainer.__init__` has `processing_class` (4.46 and later)."""
    return "processing_class" in inspect.signature(transformers.Trainer.__init__).parameters


def logits_to_keep_keyword(model) -> str | None:
    """The keyword of `model.forward` that computes logits at the last positions only, or None (the new name
    first: 4.51's Llama takes both through `**kwargs`, 5.x only `logits_to_keep`)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), None)


def framework_transformers_pin(framework_src: Path) -> str | None:
    """The transformers version the framework's requirements.txt pins, if it pins one."""
    requirements = framework_src.parent / "requirements.txt"
    if not requirements.is_file():
        return None
    match = re.search(r"^transformers\s*==\s*([\w.]+)", requirements.read_text(), re.MULTILINE)
    return match.group(1) if match else None


def stack_problem(framework_src: Path) -> str | None:
    """Why this transformers cannot run the framework checkout at `framework_src`, with the fix; else None."""
    installed = transformers.__version__
    pin = framework_transformers_pin(framework_src)
    checkout = framework_src.parent
    fix = (
        f"install the version its requirements.txt names: pip install 'transformers=={pin}'"
        if pin
        else "install the transformers version its requirements.txt names"
    )
    if pin and Version(pin).major < MAJOR_WITHOUT_4X_NAMES <= Version(installed).major:
        return (
            f"transformers {installed} is installed, but open-unlearning at {checkout} (transformers "
            f"{pin}) does not import on transformers {MAJOR_WITHOUT_4X_NAMES}.x; {fix}, or move the "
            "framework to a commit that pins 5.x (its PR #191, c3301d8)"
        )
    source = (framework_src / "trainer" / "__init__.py").read_text()  # the framework's load_trainer
    if "processing_class=processing_class" in source and not trainer_takes_processing_class():
        return (
            f"open-unlearning at {checkout} passes processing_class= to the Trainer (its transformers "
            f"{pin or 'pin'}), which transformers {installed} does not have (added in "
            f"4.46); {fix}, or check out a framework commit from before its PR #175 "
            "(d3d7cf9 runs on 4.45.1)"
        )
    return None


def training_loop_passes_num_items() -> bool:
    """Whether `Trainer.training_step` calls `compute_loss(..., num_items_in_batch=)` (4.46 and later)."""
    return "num_items_in_batch" in inspect.signature(transformers.Trainer.training_step).parameters


def compute_loss_problem(trainer_class, framework_src: Path) -> str | None:
    """Why this transformers' training loop cannot call `trainer_class.compute_loss`, with the fix; else None
    (the framework's stock trainers before its PR #175, at d3d7cf9, take no `num_items_in_batch`)."""
    if not training_loop_passes_num_items():
        return None
    parameters = inspect.signature(trainer_class.compute_loss).parameters.values()
    if any(p.name == "num_items_in_batch" or p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    pin = framework_transformers_pin(framework_src)
    return (
        f"{trainer_class.__name__}.compute_loss takes no num_items_in_batch, which transformers "
        f"{transformers.__version__} passes at every step (since 4.46), while open-unlearning at "
        f"{framework_src.parent} pins transformers {pin or '(unpinned)'}: install that "
        f"(pip install 'transformers=={pin}'), or move the framework to upstream main (4ad738a, after its "
        "PR #175)"
    )
