"""PALU's method as pure functions and small data classes: torch only, never open-unlearning."""
