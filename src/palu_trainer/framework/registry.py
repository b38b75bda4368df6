"""PALU's classes in open-unlearning's registries, and the `palu_root` resolver its configs use (the folder
holding this plugin's configs/ and span_annotations/, in a clone and in an installed wheel alike)."""

import sys

from palu_trainer.framework.checkout import RESOURCES_DIR, ensure_importable


def framework_running() -> bool:
    """Whether this process has imported open-unlearning's `data` and `trainer` (its `src/train.py` does,
    before `hydra.main` composes): the modules with the registries, not any others of those names."""
    trainer, data = sys.modules.get("trainer"), sys.modules.get("data")
    return hasattr(trainer, "_register_trainer") and hasattr(data, "_register_data")


def register_into_running_framework() -> None:
    """Called by the Hydra search-path plugin (`hydra_plugins/palu_trainer_searchpath`), which Hydra runs in
    every app as it composes: in open-unlearning's own scripts PALU registers itself, in any other Hydra app
    nothing is imported."""
    if framework_running():
        register()


def register() -> None:
    """Add the span dataset, its collator and the PALU and TPO trainers to the registries (idempotent)."""
    if not framework_running():
        ensure_importable()
    import data
    import trainer
    from omegaconf import OmegaConf

    from palu_trainer.framework.datasets import (
        DataCollatorWithTokenRoles,
        PretrainingWithSpansDataset,
        QAwithSpansDataset,
    )
    from palu_trainer.framework.trainers.palu import PALUTrainer
    from palu_trainer.framework.trainers.tpo import TPOTrainer

    data._register_data(QAwithSpansDataset)
    data._register_data(PretrainingWithSpansDataset)
    data._register_collator(DataCollatorWithTokenRoles)
    trainer._register_trainer(PALUTrainer)
    trainer._register_trainer(TPOTrainer)
    OmegaConf.register_new_resolver("palu_root", lambda: str(RESOURCES_DIR), replace=True)
