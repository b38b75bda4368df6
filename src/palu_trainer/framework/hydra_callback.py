"""The Hydra callback (`hydra.callbacks.palu_trainer`) that, under the framework's own `src/train.py` and
`src/eval.py`, checks a run's config, takes a training run's output folder and wraps the framework's loaders,
as palu-train and palu-eval do in every run (docs/layout.md)."""

import sys

from hydra.experimental.callback import Callback


class FrameworkScript(Callback):
    def on_job_start(self, config, **kwargs) -> None:
        from palu_trainer.framework.checks import config_problems
        from palu_trainer.framework.patches import patch_framework_script
        from palu_trainer.training.run_guard import RunStopped
        from palu_trainer.training.run_lock import take_output_folder

        # the framework script running: src/train.py or src/eval.py as __main__, or what palu-train imported
        scripts = [sys.modules.get(name) for name in ("__main__", "train", "eval")]
        module = next((m for m in scripts if hasattr(m, "get_model") and hasattr(m, "main")), None)
        if module is None:
            return
        script = "train" if hasattr(module, "load_trainer") else "eval"
        problems = config_problems(config, script)
        if problems:
            raise RunStopped("\n".join(problems))
        taken = script == "train" and take_output_folder(config.paths.output_dir)
        if taken:
            raise RunStopped(taken)
        self.training = script == "train"
        patch_framework_script(module, config)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        """A run that raised: its folder marked failed, and the crashes a user can fix told in one line
        (`training.crashes`); anything else keeps Hydra's own report."""
        from hydra.core.utils import JobStatus

        from palu_trainer.training.crashes import crash_problem, mark_crashed
        from palu_trainer.training.run_guard import RunStopped

        if job_return.status != JobStatus.FAILED:
            return
        error = job_return._return_value
        training = getattr(self, "training", False)
        problem = mark_crashed(config.paths.output_dir, error) if training else crash_problem(error)
        if problem:
            raise RunStopped(problem)
