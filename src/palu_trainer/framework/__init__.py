"""Everything that touches open-unlearning. `checkout` is the ground floor; `cli` (palu-train, palu-eval) the
top floor."""
