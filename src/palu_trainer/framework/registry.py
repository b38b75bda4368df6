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
    """Register PALU when Hydra runs the search-path plugin (`hydra_plugins/palu_trainer_searchpath`) in
    open-unlearning's own scripts, whose data and evaluators then read `TOFU_DIR`/`MUSE_DIR` whatever the
    experiment; in any other Hydra app nothing is imported."""
    if framework_running():
        from palu_trainer.framework.patches import noting_summed_accumulation

        register()
        noting_summed_accumulation()
        script = sys.modules.get("__main__")
        if hasattr(script, "get_evaluators") and hasattr(script, "main"):
            from palu_trainer.framework.patches import reading_local_mirrors

            reading_local_mirrors(script)


def register() -> None:
    """Add the span dataset, its collator and the PALU and TPO trainers to the registries, and let torch load
    what resumable checkpoints hold (idempotent)."""
    if not framework_running():
        ensure_importable()
    import data
    import trainer
    from omegaconf import OmegaConf

    from palu_trainer.framework import datasets
    from palu_trainer.framework.patches import allowing_checkpoint_globals
    from palu_trainer.framework.trainers.palu import PALUTrainer
    from palu_trainer.framework.trainers.tpo import TPOTrainer

    data._register_data(datasets.QAwithSpansDataset)
    data._register_data(datasets.PretrainingWithSpansDataset)
    data._register_collator(datasets.DataCollatorWithTokenRoles)
    trainer._register_trainer(PALUTrainer)
    trainer._register_trainer(TPOTrainer)
    OmegaConf.register_new_resolver("palu_root", lambda: str(RESOURCES_DIR), replace=True)
    allowing_checkpoint_globals()  # a run that resumes loads them, under any entry point
