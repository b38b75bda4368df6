"""Span annotations: the file format, the model-free annotator, TPO import, agreement scores, CLI."""
