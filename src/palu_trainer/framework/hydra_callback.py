"""The Hydra callback that checks a run's config and wraps the framework's loaders, under the framework's own
`src/train.py`/`src/eval.py` and under palu-train/palu-eval alike.

Hydra calls `on_job_start` with the composed config after it made the output folder and before the script's
`main`: the callback refuses a bad config there (`checks.CONFIG_CHECKS`, the message alone, exit 1), a
training run takes its output folder for itself (`run_lock`), and it wraps the running script's `get_model`,
`get_data` and `load_trainer` (`patches.patch_framework_script`). It is switched on by a config:
`hydra.callbacks.palu_trainer` in this plugin's experiment YAMLs and in `configs/peft/lora.yaml`; palu-train
and palu-eval run the same checks before Hydra starts and call the same patch in every run.
"""

import sys
from types import ModuleType

from hydra.experimental.callback import Callback


def framework_script() -> ModuleType | None:
    """The running framework script's module: `src/train.py` or `src/eval.py` run as `__main__`, or the
    `train`/`eval` module palu-train imported."""
    for name in ("__main__", "train", "eval"):
        module = sys.modules.get(name)
        if hasattr(module, "get_model") and hasattr(module, "main"):
            return module
    return None


class FrameworkScript(Callback):
    def on_job_start(self, config, **kwargs) -> None:
        from palu_trainer.framework.checks import config_problems
        from palu_trainer.framework.patches import patch_framework_script
        from palu_trainer.framework.run_guard import RunStopped
        from palu_trainer.training.run_lock import take_output_folder

        module = framework_script()
        if module is None:
            return
        script = "train" if hasattr(module, "load_trainer") else "eval"
        problems = config_problems(config, script)
        if problems:
            raise RunStopped("\n".join(problems))
        if script == "train":
            taken = take_output_folder(config.paths.output_dir)
            if taken:
                raise RunStopped(taken)
        patch_framework_script(module, config)
