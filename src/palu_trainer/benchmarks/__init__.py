"""Local benchmark data in Hugging Face dataset folders: synthetic TOFU and real-TOFU subsets."""
