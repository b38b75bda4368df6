"""Reading local benchmark data in Hugging Face dataset folders (the lab writes them)."""
