"""Synthetic and subset benchmarks in Hugging Face dataset folders, for the miniature."""
