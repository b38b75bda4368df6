"""A trainer's config as `trainer=<name>` composes it, for the experiments that read its defaults."""

from palu_trainer.framework.checkout import checkout_dir


def trainer_config(name: str, overrides=()):
    """The composed config `trainer=<name>` (the framework's or this plugin's) with `trainer.*` overrides."""
    from hydra import compose, initialize_config_dir

    # without the groups the trainer node does not read (the evaluation's metrics are most of a composition:
    # 3 s, against 0.2 s without them; the same trainer node, resolved, for every method of the table)
    unread = ["~eval", "~data", "~model", "~collator"]
    with initialize_config_dir(config_dir=str(checkout_dir() / "configs"), version_base=None):
        overrides = [f"trainer={name}", "task_name=config", *unread, *overrides]
        return compose(config_name="unlearn.yaml", overrides=overrides).trainer
