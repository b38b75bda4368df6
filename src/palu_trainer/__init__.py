"""PALU (Prefix-Aware Localized Unlearning) as a plugin for open-unlearning."""

__version__ = "0.1.0"
