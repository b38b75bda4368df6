"""Makes palu-trainer's configs/ visible to every Hydra app, and registers PALU in open-unlearning's
registries when the app is one of the framework's own scripts (`src/train.py`, `src/eval.py`): Hydra runs
this plugin as it composes, after those scripts imported their registries and before their `main`."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class PALUSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from palu_trainer.framework.checkout import CONFIG_DIR
        from palu_trainer.framework.registry import register_into_running_framework

        search_path.append(provider="palu-trainer", path=f"file://{CONFIG_DIR}")
        register_into_running_framework()
