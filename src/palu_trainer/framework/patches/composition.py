"""palu-train's Hydra run given the config its precheck composed (Hydra 1.3 composes it twice more)."""

import functools
from collections import Counter

from omegaconf import open_dict, read_write


def composing_once(composed) -> None:
    """Hydra 1.3 composes the whole config twice per run, once only to read `hydra.mode`, and palu-train's
    precheck composes it before either: the run reads the mode from the precheck's config and gets that config
    as its own composition when its config name and overrides are the precheck's (two compositions, 1 to 2 s
    each on a CPU, fewer per launch)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra.types import RunMode

    if hasattr(Hydra, "get_mode"):
        Hydra.get_mode = lambda self, config_name, overrides, mode=composed.hydra.mode: mode
    load_configuration = ConfigLoaderImpl.load_configuration
    precomposed = [composed]
    given = Counter([*composed.hydra.overrides.hydra, *composed.hydra.overrides.task])
    run_mode_unset = Counter(["hydra.mode=RUN"])  # what Hydra's run adds when the config leaves it unset

    @functools.wraps(load_configuration)
    def load_once(self, config_name, overrides, run_mode, *args, **kwargs):
        added = Counter(overrides) - given
        if (
            precomposed
            and run_mode == RunMode.RUN
            and config_name == composed.hydra.job.config_name
            and not given - Counter(overrides)
            and added in (Counter(), run_mode_unset)
        ):
            cfg = precomposed.pop()
            if added:
                with read_write(cfg.hydra), open_dict(cfg.hydra):
                    cfg.hydra.mode = RunMode.RUN
                    cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
            return cfg
        return load_configuration(self, config_name, overrides, run_mode, *args, **kwargs)

    ConfigLoaderImpl.load_configuration = load_once
