"""The lab: the miniature, the real-model experiments and the synthetic benchmarks behind this
repository's numbers, over the palu-trainer plugin. `make setup` installs it for contributors; the plugin's
wheel does not hold it."""
