"""The Hydra callback (`hydra.callbacks.palu_trainer` in this plugin's experiment YAMLs and in
`configs/peft/lora.yaml`) that checks a run's config and wraps the framework's loaders under its own
`src/train.py`/`src/eval.py`, as palu-train/palu-eval do in every run (docs/layout.md).

Hydra calls `on_job_start` with the composed config after it made the output folder and before the script's
`main`: a bad config stops there with the message alone, and a training run takes its output folder.
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
