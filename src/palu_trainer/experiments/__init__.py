"""Runners over the framework: the offline demo, the GPU recipe, the report, tiny models, the method table."""
