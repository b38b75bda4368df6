"""Trainers registered into open-unlearning's TRAINER_REGISTRY by `palu_trainer.framework.registry`."""
