"""PALU's classes in open-unlearning's registries, and the `palu_root` resolver its configs use (the folder
holding this plugin's configs/ and span_annotations/, in a clone and in an installed wheel alike)."""

from palu_trainer.framework.checkout import RESOURCES_DIR, ensure_importable


def register() -> None:
    """Add the span dataset, its collator and the PALU and TPO trainers to the registries (idempotent)."""
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
