"""Runners over the framework: the GPU recipe and its kit (palu-recipe), the report, the method table."""
