"""`palu-train` and `palu-eval`: open-unlearning's own `train.py`/`eval.py` `main` under a Hydra app that
first registers PALU, refuses command-line and config mistakes and points hub dataset loads at local
mirrors (`TOFU_DIR`, `MUSE_DIR`)."""

import contextlib
import importlib
import io
import logging
import sys
import warnings
from pathlib import Path

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.framework.model_paths import command_line_model_problem, model_problems

logger = logging.getLogger(__name__)

USAGE = """usage: {prog} [--config-name=NAME] [key=value ...]   (Hydra overrides of open-unlearning's configs)

  open-unlearning's src/{script}.py with PALU registered and this plugin's configs/ on the search path.

PALU on TOFU (palu-train --config-name=unlearn.yaml):
  experiment=unlearn/tofu/palu        PALU trainer, span-annotated forget set, TOFU evaluation
  forget_split=forget05 retain_split=retain95 holdout_split=holdout05
  span_annotations=PATH               span file (default span_annotations/tofu_<forget_split>.jsonl)
  num_initiating_tokens=3             N: leading tokens of each span that get the local entropy loss
  min_initiating_tokens=auto          stop before training below this many initiating tokens
                                      (auto: one per 10 forget rows; 0 allows retain-only training)
  trainer.method_args.top_k=0.15625   K (share of |V|, or an integer);  .kl_weight=1.0;  .target=global_mean
  trainer.method_args.reference_cache=auto   auto | true | false;  .reference_cache_max_gib=4.0 (per rank)
  +trainer.args.resume_from_checkpoint=DIR   resume (a checkpoint-N folder, or true for the last one)
Baselines: experiment=unlearn/tofu/default trainer=NPO (SimNPO, GradDiff, ...)
Machine and data:
  +runtime=cpu                        required without CUDA (adamw_torch, fp32, no bf16, warm-up ratio)
  model=tiny-llama                    small local models (set model.*_args.pretrained_model_name_or_path)
  TOFU_DIR=/path/to/tofu              environment variable: read locuslab/TOFU from a local mirror
Full help: {prog} --help-full (Hydra's help and every default), {prog} ... --cfg job (the composed config).
"""


def refuse(prog: str, problem: str | None) -> None:
    """Exit with `problem`, if there is one, named by the command `prog`."""
    if problem:
        sys.exit(f"{prog}: {problem}")


def composed_run_config(config_name: str, config_dir: Path, argv) -> tuple | None:
    """The config (with its `hydra` node) that Hydra composes from `argv`, and whether it is the one Hydra's
    run composes (no --config-path or --config-dir); None for Hydra's other modes (help, --cfg, multirun)
    and for a command line or config Hydra cannot compose (its own run reports those). Hydra alone: no
    framework, torch or transformers import."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = get_args_parser().parse_args(argv)
    except SystemExit:
        return None
    if args.cfg or args.info or args.multirun or args.shell_completion or args.help or args.hydra_help:
        return None
    try:
        # Hydra's and omegaconf's deprecation warnings, which Hydra's own composition prints once more
        with (
            warnings.catch_warnings(action="ignore"),
            # job_name: the one hydra.main gives the job, after this file
            initialize_config_dir(
                config_dir=str(config_dir), version_base=None, job_name=Path(__file__).stem
            ),
        ):
            cfg = compose(args.config_name or config_name, overrides=args.overrides, return_hydra_config=True)
    except Exception:  # noqa: BLE001 (a config Hydra cannot compose: Hydra's own run reports it)
        return None
    return cfg, not (args.config_path or args.config_dir)


def precheck(prog: str, script: str, argv, composed: tuple | None):
    """Refuse command-line and config mistakes before Hydra starts the job (and makes the output folder).
    Returns the composed config when it is the one Hydra's run composes, else None."""
    from palu_trainer.framework.checks import CONFIG_WARNINGS, argv_problem, config_problems

    refuse(prog, argv_problem(argv))
    if composed is None:
        return None
    cfg, composed_by_the_run = composed
    problems = config_problems(cfg, script)
    if problems:
        sys.exit("\n".join(f"{prog}: {problem}" for problem in problems))
    for warning in config_problems(cfg, script, CONFIG_WARNINGS):
        print(f"{prog}: WARNING: {warning}", file=sys.stderr)
    return cfg if composed_by_the_run else None


def run_framework_script(script: str, config_name: str) -> None:
    """Run the framework's `script` (train | eval) on `sys.argv` with `config_name`, as its entry point."""
    prog = Path(sys.argv[0]).name
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(USAGE.format(prog=prog, script=script), end="")
        return
    sys.argv = [("--help" if arg == "--help-full" else arg) for arg in sys.argv]
    argv = sys.argv[1:]
    # a mistyped path or an offline hub id, in a second or two: before torch's and the framework's imports
    refuse(prog, command_line_model_problem(argv, script))
    src = ensure_importable()
    checked_composition(prog, script, config_name, src, argv)
    import hydra

    module = importlib.import_module(script)

    @hydra.main(version_base=None, config_path=str(src.parent / "configs"), config_name=config_name)
    def main(cfg):
        prepare_job(prog, script, module, cfg, src)
        run_job(prog, script, module, cfg)

    main()


def checked_composition(prog: str, script: str, config_name: str, src: Path, argv) -> None:
    """Compose the run's config once, refuse its mistakes and the stack's, register PALU and take a training
    run's output folder, all before Hydra's run starts; the run then reuses this composition. The model paths
    are checked before torch, transformers or the framework is imported."""
    composed = composed_run_config(config_name, src.parent / "configs", argv)
    if composed is not None:
        refuse(prog, model_problems(composed[0], script))
    from palu_trainer.framework.patches.composition import composing_once
    from palu_trainer.framework.registry import register
    from palu_trainer.framework.stack import stack_problem
    from palu_trainer.training.run_lock import take_output_folder

    refuse(prog, stack_problem(src))
    register()
    composed = precheck(prog, script, argv, composed)
    if composed is not None:
        if script == "train":
            # before Hydra writes the run's .hydra/ and log into the folder, which another run may hold
            refuse(prog, take_output_folder(composed.paths.output_dir))
        composing_once(composed)


def prepare_job(prog: str, script: str, module, cfg, src: Path) -> None:
    """In Hydra's job: the CPU runtime check, the local dataset mirrors and the framework script's loaders
    wrapped; for training, the trainer's `compute_loss` and the checkpoint to resume from checked."""
    import torch
    from hydra.core.hydra_config import HydraConfig

    from palu_trainer.framework import checks, provenance
    from palu_trainer.framework.local_mirrors import redirect_to_local_mirrors
    from palu_trainer.framework.patches import patch_framework_script, patch_palu_train_script
    from palu_trainer.framework.stack import compute_loss_problem
    from palu_trainer.training.resume import checkpoint_to_resume, resumed_model_problem

    runtime = HydraConfig.get().runtime.choices.get("runtime")
    refuse(prog, checks.cpu_runtime_missing(runtime, torch.cuda.is_available()))
    try:
        for line in redirect_to_local_mirrors(cfg):
            logger.info("local dataset mirror: %s", line)
    except FileNotFoundError as error:
        sys.exit(f"{prog}: {error}")
    patch_framework_script(module, cfg)  # what the Hydra callback does under src/train.py
    if script != "train":
        return
    from trainer import TRAINER_REGISTRY

    trainer_class = TRAINER_REGISTRY.get(cfg.trainer.get("handler"))
    refuse(prog, trainer_class and compute_loss_problem(trainer_class, src))
    args = cfg.trainer.args
    try:
        checkpoint = checkpoint_to_resume(args.get("resume_from_checkpoint"), args.output_dir, logger.warning)
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"{prog}: {error}")
    refuse(prog, resumed_model_problem(checkpoint, cfg.model.model_args.get("pretrained_model_name_or_path")))
    if warning := checkpoint and provenance.mid_epoch_warning(checkpoint):
        logger.warning(warning)
    patch_palu_train_script(module, checkpoint, bool(cfg.get(provenance.ALLOW_OTHER_DATA, False)))


def run_job(prog: str, script: str, module, cfg) -> None:
    """The framework's main on `cfg`, without its own hydra.main; bad input and the crashes a user can fix
    end in one line, a training run's folder marked failed."""
    from palu_trainer.framework import checks
    from palu_trainer.framework.local_mirrors import hub_hint
    from palu_trainer.training.crashes import crash_problem, mark_crashed

    try:
        module.main.__wrapped__(cfg)
        release_process_group()
    except checks.BadInput as error:
        sys.exit(f"{prog}: {error}")
    except Exception as error:
        crashed = mark_crashed(cfg.paths.output_dir, error) if script == "train" else crash_problem(error)
        refuse(prog, hub_hint(error) or crashed)
        raise


def release_process_group() -> None:
    """End a distributed run's process group once every rank is done. The framework leaves it to the
    interpreter's exit, where a rank's gloo threads can abort ("terminate called without an active
    exception"): seen once in a 2-rank ZeRO-3 test on a loaded machine, after all steps had finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train_main() -> None:
    """`palu-train`: open-unlearning's train.py, with PALU registered and its configs visible."""
    run_framework_script("train", "train.yaml")


def eval_main() -> None:
    """`palu-eval`: open-unlearning's eval.py, likewise."""
    run_framework_script("eval", "eval.yaml")
