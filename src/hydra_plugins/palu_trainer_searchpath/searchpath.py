"""Makes palu-trainer's configs/ visible to every Hydra app, open-unlearning's scripts included."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class PALUSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from palu_trainer.framework.checkout import CONFIG_DIR

        search_path.append(provider="palu-trainer", path=f"file://{CONFIG_DIR}")
