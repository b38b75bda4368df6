"""Trainers outside palu-train, for the experiments, the bench and the tests: a trainer's config as
`trainer=<name>` composes it (for those that read its defaults), and the Trainer keyword of the tokenizer
on this transformers (for those that build a Trainer themselves)."""

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


def tokenizer_keyword(tokenizer) -> dict:
    """The Trainer keyword that hands it the tokenizer on this transformers: processing_class or tokenizer."""
    from palu_trainer.framework.stack import trainer_takes_processing_class

    return {"processing_class" if trainer_takes_processing_class() else "tokenizer": tokenizer}
