"""The framework-and-transformers stack this process runs on, detected, never pinned. The tested framework
states (docs/setup.md) differ in what a trainer sees: `processing_class=` (transformers 4.46),
`compute_loss(..., num_items_in_batch=)`, `logits_to_keep` (4.50) where it was `num_logits_to_keep`. Each
difference is read off the installed code, so a newer release that keeps an interface keeps working, and a
combination that cannot work is named with its fix before anything loads.
"""

import inspect
import re
from pathlib import Path

import transformers

# A framework commit that pins transformers 4.x imports names that 5.x removed (AutoModelForVision2Seq in
# train.py and its stock trainers); its PR #191 pins 5.5.4 and imports on it.
MAJOR_WITHOUT_4X_NAMES = 5
PROCESSING_CLASS_SINCE = "4.46"


def transformers_version() -> str:
    return transformers.__version__


def major(version: str) -> int:
    return int(version.split(".")[0])


def trainer_takes_processing_class() -> bool:
    """Whether `transformers.Trainer.__init__` has `processing_class` (4.46 and later)."""
    return "processing_class" in inspect.signature(transformers.Trainer.__init__).parameters


def logits_to_keep_keyword(model) -> str | None:
    """The keyword of `model.forward` that computes logits at the last positions only, or None.

    transformers 4.50 renamed `num_logits_to_keep` to `logits_to_keep` (4.51's Llama still takes both through
    `**kwargs`, 5.x only the new one); a model whose forward names neither computes every position's logits.
    """
    parameters = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in parameters:
            return name
    return None


def framework_passes_processing_class(framework_src: Path) -> bool:
    """Whether the framework's `load_trainer` (src/trainer/__init__.py) passes `processing_class`."""
    source = (framework_src / "trainer" / "__init__.py").read_text()
    return "processing_class=processing_class" in source


def framework_transformers_pin(framework_src: Path) -> str | None:
    """The transformers version the framework's requirements.txt pins, if it pins one."""
    requirements = framework_src.parent / "requirements.txt"
    if not requirements.is_file():
        return None
    match = re.search(r"^transformers\s*==\s*([\w.]+)", requirements.read_text(), re.MULTILINE)
    return match.group(1) if match else None


def stack_problem(framework_src: Path) -> str | None:
    """Why this transformers cannot run the framework checkout at `framework_src`, with the fix; else None."""
    installed = transformers_version()
    pin = framework_transformers_pin(framework_src)
    checkout = framework_src.parent
    fix = (
        f"install the version its requirements.txt names: pip install 'transformers=={pin}'"
        if pin
        else "install the transformers version its requirements.txt names"
    )
    if major(installed) >= MAJOR_WITHOUT_4X_NAMES and pin and major(pin) < MAJOR_WITHOUT_4X_NAMES:
        return (
            f"transformers {installed} is installed, but open-unlearning at {checkout} (transformers "
            f"{pin}) does not import on transformers {MAJOR_WITHOUT_4X_NAMES}.x; {fix}, or move the "
            "framework to a commit that pins 5.x (its PR #191, c3301d8)"
        )
    if framework_passes_processing_class(framework_src) and not trainer_takes_processing_class():
        return (
            f"open-unlearning at {checkout} passes processing_class= to the Trainer (its transformers "
            f"{pin or 'pin'}), which transformers {installed} does not have (added in "
            f"{PROCESSING_CLASS_SINCE}); {fix}, or check out a framework commit from before its PR #175 "
            "(d3d7cf9 runs on 4.45.1)"
        )
    return None


def rotate_checkpoints(trainer, output_dir: str) -> None:
    """Delete `output_dir`'s oldest checkpoints beyond `save_total_limit`, as the Trainer does after a save:
    its method `_rotate_checkpoints` up to transformers 4.x, the function `trainer_utils.rotate_checkpoints`
    that 5.x replaced it with."""
    if hasattr(trainer, "_rotate_checkpoints"):
        trainer._rotate_checkpoints(use_mtime=False, output_dir=output_dir)
        return
    from transformers.trainer_utils import rotate_checkpoints as rotate

    rotate(
        output_dir=output_dir,
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
    )


def training_loop_passes_num_items() -> bool:
    """Whether `Trainer.training_step` calls `compute_loss(..., num_items_in_batch=)` (4.46 and later)."""
    return "num_items_in_batch" in inspect.signature(transformers.Trainer.training_step).parameters


def compute_loss_problem(trainer_class, framework_src: Path) -> str | None:
    """Why this transformers' training loop cannot call `trainer_class.compute_loss`, with the fix; else None.

    The framework's stock trainers before its PR #175 take no `num_items_in_batch`, which every step of
    transformers 4.46 and later passes: the framework at d3d7cf9 needs its own transformers 4.45.1.
    """
    if not training_loop_passes_num_items():
        return None
    parameters = inspect.signature(trainer_class.compute_loss).parameters.values()
    if any(p.name == "num_items_in_batch" or p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    pin = framework_transformers_pin(framework_src)
    return (
        f"{trainer_class.__name__}.compute_loss takes no num_items_in_batch, which transformers "
        f"{transformers_version()} passes at every step (since 4.46), while open-unlearning at "
        f"{framework_src.parent} pins transformers {pin or '(unpinned)'}: install that "
        f"(pip install 'transformers=={pin}'), or move the framework to upstream main (4ad738a, after its "
        "PR #175)"
    )
