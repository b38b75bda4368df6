"""Everything that touches open-unlearning. `checkout` is the ground floor; `plugin` the top floor."""
