"""A trainer's config as `trainer=<name>` composes it, for the experiments that read its defaults."""

from palu_trainer.framework.checkout import checkout_dir


def trainer_config(name: str, overrides=()):
    """The composed config `trainer=<name>` (the framework's or this plugin's) with `trainer.*` overrides."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(checkout_dir() / "configs"), version_base=None):
        overrides = [f"trainer={name}", "task_name=config", *overrides]
        return compose(config_name="unlearn.yaml", overrides=overrides).trainer
