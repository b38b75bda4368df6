"""A training run's protection and model helpers that touch transformers and torch, never open-unlearning,
Hydra or the checkout: below `framework`, which wires them into the framework's runs."""
