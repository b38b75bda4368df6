"""Top floor: PALU's classes in open-unlearning's registries, local dataset mirrors, entry points.

`palu-train` and `palu-eval` run the framework's own `train.py`/`eval.py` `main` under a Hydra app that
first registers PALU and points hub dataset loads at local mirrors (`TOFU_DIR`, `MUSE_DIR`).
"""

import functools
import hashlib
import importlib
import json
import logging
import os
import sys
from pathlib import Path

import yaml

from palu_trainer.benchmarks.hf_dir import missing_data_files, read_configs
from palu_trainer.framework.checkout import PROJECT_ROOT, checkout_dir, ensure_importable

logger = logging.getLogger(__name__)

# Hub dataset ids that an environment variable can point at a local directory with the same configs.
LOCAL_MIRRORS = {"locuslab/TOFU": "TOFU_DIR", "muse-bench/MUSE-News": "MUSE_DIR"}


def register() -> None:
    """Add the span dataset, its collator and the PALU and TPO trainers to the registries (idempotent)."""
    ensure_importable()
    import data
    import trainer
    from omegaconf import OmegaConf

    from palu_trainer.framework.datasets import (
        DataCollatorWithTokenRoles,
        PretrainingWithSpansDataset,
        QAwithSpansDataset,
    )
    from palu_trainer.framework.trainers.palu import PALUTrainer
    from palu_trainer.framework.trainers.tpo import TPOTrainer

    data._register_data(QAwithSpansDataset)
    data._register_data(PretrainingWithSpansDataset)
    data._register_collator(DataCollatorWithTokenRoles)
    trainer._register_trainer(PALUTrainer)
    trainer._register_trainer(TPOTrainer)
    OmegaConf.register_new_resolver("palu_root", lambda: str(PROJECT_ROOT), replace=True)


def trainer_config(name: str, overrides=()):
    """The composed config `trainer=<name>` (the framework's or this plugin's) with `trainer.*` overrides."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(checkout_dir() / "configs"), version_base=None):
        overrides = [f"trainer={name}", "task_name=config", *overrides]
        return compose(config_name="unlearn.yaml", overrides=overrides).trainer


def dataset_loads(cfg, trail: str = ""):
    """Yield (config path, hf_args node) for every dataset load in a composed config (few-shot ones too)."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(cfg, DictConfig):
        items = [(key, cfg._get_node(key)) for key in cfg.keys()]
    elif isinstance(cfg, ListConfig):
        items = [(index, cfg._get_node(index)) for index in range(len(cfg))]
    else:
        return
    for key, child in items:
        if not isinstance(child, (DictConfig, ListConfig)) or child._is_interpolation():
            continue
        if str(key).endswith("hf_args") and isinstance(child, DictConfig):
            yield f"{trail}.{key}".lstrip("."), child
        else:
            yield from dataset_loads(child, f"{trail}.{key}")


def mirror_cache_dir(mirror_dir: Path) -> Path:
    """A `datasets` cache folder for this mirror's current contents.

    `datasets` caches a local folder under its base name: an edited file, or another mirror with the same
    folder name, would be served from the old cache. The folder's path and its files' bytes key this one.
    """
    import datasets

    digest = hashlib.sha1(str(mirror_dir).encode())
    for path in sorted(mirror_dir.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return (
        Path(datasets.config.HF_DATASETS_CACHE)
        / "palu_mirrors"
        / f"{mirror_dir.name}-{digest.hexdigest()[:16]}"
    )


def redirect_to_local_mirrors(cfg, environ=os.environ) -> list[str]:
    """Point every load of a mirrored hub dataset at its local directory; return what changed.

    Fails before anything loads when the directory lacks a config or split some load needs. Each load gets the
    mirror's own cache folder (`mirror_cache_dir`), so it reads the mirror's current files.
    """
    from omegaconf import open_dict

    redirected = []
    for hub_id, variable in LOCAL_MIRRORS.items():
        if not environ.get(variable):
            continue
        mirror_dir = Path(environ[variable]).expanduser().resolve()
        if not mirror_dir.is_dir():
            raise FileNotFoundError(
                f"{variable}={mirror_dir}: no such folder; point {variable} at a local copy of {hub_id} (its "
                "JSON files and the hub README listing the configs), or unset it to read the Hub"
            )
        available = read_configs(mirror_dir)
        cache_dir = None
        for where, hf_args in dataset_loads(cfg):
            if hf_args.get("path") != hub_id:
                continue
            name, split = hf_args.get("name"), hf_args.get("split", "train")
            if name not in available or split not in available[name]:
                missing = f"config {name!r}" + (f" with split {split!r}" if name in available else "")
                offered = ", ".join(
                    f"{config}/{'|'.join(sorted(splits))}" for config, splits in available.items()
                )
                raise FileNotFoundError(
                    f"{variable}={mirror_dir} has no dataset {missing}, needed by {where}. It offers: "
                    f"{offered}. Add that split to the mirror or drop the metric/dataset that needs it."
                )
            missing = missing_data_files(mirror_dir, name, split)
            if missing:
                raise FileNotFoundError(
                    f"{variable}={mirror_dir}: the README lists config {name!r} (split {split!r}, needed by "
                    f"{where}) in {missing}, which the folder lacks. Copy the file(s) there or drop the "
                    "config from the README"
                )
            cache_dir = cache_dir or mirror_cache_dir(mirror_dir)
            with open_dict(hf_args):
                hf_args.path = str(mirror_dir)
                hf_args.cache_dir = str(cache_dir)
            redirected.append(f"{where}: {name}")
    return redirected


def write_accelerate_config(directory: Path, num_processes: int, bf16: bool | str = True) -> Path:
    """The framework's accelerate + ZeRO-3 configs, made launchable from any directory.

    Its accelerate config names the DeepSpeed JSON by a path relative to the checkout; this writes both
    into `directory` with an absolute path, `num_processes` and DeepSpeed's bf16 setting (`auto` follows
    TrainingArguments, as CPU runs need).
    """
    source = checkout_dir() / "configs" / "accelerate"
    deepspeed = json.loads((source / "zero_stage3_offload_config.json").read_text())
    deepspeed["bf16"]["enabled"] = bf16
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "zero3.json").write_text(json.dumps(deepspeed, indent=2))
    accelerate = yaml.safe_load((source / "default_config.yaml").read_text())
    accelerate["deepspeed_config"]["deepspeed_config_file"] = str((directory / "zero3.json").resolve())
    accelerate["num_processes"] = num_processes
    (directory / "accelerate.yaml").write_text(yaml.safe_dump(accelerate))
    return directory / "accelerate.yaml"


USAGE = """usage: {prog} [--config-name=NAME] [key=value ...]   (Hydra overrides of open-unlearning's configs)

  open-unlearning's src/{script}.py with PALU registered and this plugin's configs/ on the search path.

PALU on TOFU (palu-train --config-name=unlearn.yaml):
  experiment=unlearn/tofu/palu        PALU trainer, span-annotated forget set, TOFU evaluation
  forget_split=forget05 retain_split=retain95 holdout_split=holdout05
  span_annotations=PATH               span file (default span_annotations/tofu_<forget_split>.jsonl)
  num_initiating_tokens=3             N: leading tokens of each span that get the local entropy loss
  min_initiating_tokens=auto          stop before training below this many initiating tokens
                                      (auto: one per 10 forget rows; 0 allows retain-only training)
  trainer.method_args.top_k=5000      K;  .kl_weight=1.0 (lambda);  .target=global_mean
  trainer.method_args.reference_cache=auto   auto | true | false;  .reference_cache_max_gib=4.0 (per rank)
  +trainer.args.resume_from_checkpoint=DIR   resume (a checkpoint-N folder, or true for the last one)
Baselines: experiment=unlearn/tofu/default trainer=NPO (SimNPO, GradDiff, ...)
Machine and data:
  +runtime=cpu                        required without CUDA (adamw_torch, fp32, no bf16, warm-up ratio)
  model=tiny-llama                    small local models (set model.*_args.pretrained_model_name_or_path)
  TOFU_DIR=/path/to/tofu              environment variable: read locuslab/TOFU from a local mirror
Full help: {prog} --help-full (Hydra's help and every default), {prog} ... --cfg job (the composed config).
"""


def usage(prog: str, script: str) -> str:
    """The short `--help` of palu-train/palu-eval."""
    return USAGE.format(prog=prog, script=script)


def cpu_runtime_missing(runtime_choice: str | None, cuda_available: bool) -> str | None:
    """The error for a run without CUDA and without the `+runtime=cpu` overlay, else None.

    Without it the framework's warm-up divides by the CUDA device count ("float floor division by
    zero") and its optimizer and bf16 defaults need a GPU.
    """
    if cuda_available or runtime_choice == "cpu":
        return None
    return (
        "no CUDA device: add `+runtime=cpu` to the command line (adamw_torch, fp32, no bf16, warm-up as a "
        "ratio, device_map=cpu; configs/runtime/cpu.yaml)"
    )


def checkpoint_to_resume(resume_from_checkpoint, output_dir: str) -> str | None:
    """The checkpoint folder `trainer.args.resume_from_checkpoint` names, checked to hold optimizer state.

    `true` means the last `checkpoint-N` in `output_dir`. Fails before anything loads when there is none,
    or when the checkpoint holds only the model (`save_only_model=true`), which cannot resume training.
    """
    from transformers.trainer_utils import get_last_checkpoint

    if resume_from_checkpoint in (None, False, "", "false", "False"):
        return None
    if resume_from_checkpoint in (True, "true", "True"):
        last = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
        if last is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint=true: no checkpoint-N folder in {output_dir}; name one"
            )
        resume_from_checkpoint = last
    checkpoint = Path(resume_from_checkpoint)
    if not (checkpoint / "trainer_state.json").is_file():
        raise FileNotFoundError(
            f"resume_from_checkpoint={checkpoint}: not a Trainer checkpoint (no trainer_state.json)"
        )
    if not ((checkpoint / "optimizer.pt").is_file() or any(checkpoint.glob("global_step*"))):
        raise ValueError(
            f"resume_from_checkpoint={checkpoint} holds no optimizer state (saved with save_only_model=true, "
            "the framework's default): it cannot resume. Save checkpoints with "
            "trainer.args.save_only_model=false (PALU's config does)"
        )
    return str(checkpoint)


FINAL_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*.safetensors",
    "pytorch_model*.bin",
)


def remove_stale_weights(output_dir: str) -> list[str]:
    """Delete an earlier run's final weights from `output_dir` before training into it.

    The framework writes them only after the last step: left in place, an interrupted run would leave
    the old model beside its new checkpoints, looking finished.
    """
    stale = sorted({path for pattern in FINAL_WEIGHTS for path in Path(output_dir).glob(pattern)})
    for path in stale:
        path.unlink()
    return [path.name for path in stale]


def allow_numpy_rng_state() -> None:
    """Let transformers 4.45 read a checkpoint's `rng_state.pth` under torch >= 2.6.

    Its `torch.load` now defaults to weights_only=True, which rejects the numpy RNG state the Trainer
    saved; later transformers allowlist these same numpy types.
    """
    import numpy
    import torch

    numpy_types = [
        numpy._core.multiarray._reconstruct,
        numpy.ndarray,
        numpy.dtype,
        type(numpy.dtype(numpy.uint32)),
    ]
    torch.serialization.add_safe_globals(numpy_types)


def _resuming(load_trainer, checkpoint: str | None, allow_other_data: bool = False):
    """The framework's `load_trainer`, whose trainer resumes from `checkpoint` (train.py calls `train()`).

    Its checkpoints record the run's data (`checks.RunDataCallback`); resuming on other data is refused.
    """
    from palu_trainer.framework.checks import BadInput, RunDataCallback, resume_data_problem, run_data

    @functools.wraps(load_trainer)
    def load(*args, **kwargs):
        trainer, trainer_args = load_trainer(*args, **kwargs)
        record = run_data(trainer.train_dataset)
        if checkpoint is not None:
            error, warning = resume_data_problem(checkpoint, record)
            if error and not allow_other_data:
                raise BadInput(error)
            if warning or error:
                logger.warning(warning or error)
        trainer.add_callback(RunDataCallback(record))
        if trainer_args.do_train:
            removed = remove_stale_weights(trainer_args.output_dir)
            if removed:
                logger.warning(
                    "removed an earlier run's final weights from %s: %s", trainer_args.output_dir, removed
                )
        if checkpoint is not None:
            logger.info("resuming from %s", checkpoint)
            allow_numpy_rng_state()
            trainer.train = functools.partial(trainer.train, resume_from_checkpoint=checkpoint)
        return trainer, trainer_args

    return load


def _checking_vocabulary(get_model):
    """The framework's `get_model`, refusing a tokenizer that does not fit the model's vocabulary."""
    from palu_trainer.framework.checks import BadInput
    from palu_trainer.framework.vocabulary import model_vocab_size, vocabulary_mismatch

    @functools.wraps(get_model)
    def load(model_cfg, *args, **kwargs):
        model, tokenizer = get_model(model_cfg, *args, **kwargs)
        names = [getattr(loaded, "name_or_path", "") for loaded in (tokenizer, model)]
        error, warning = vocabulary_mismatch(len(tokenizer), model_vocab_size(model), *names)
        if error:
            raise BadInput(error)
        if warning:
            logger.warning(warning)
        return model, tokenizer

    return load


def _checking_data(get_data, cfg):
    """The framework's `get_data`, refusing forget rows that are also retain rows (unless allowed).

    A bad span file (AnnotationError: file, row and fix named) ends the run with its message alone.
    """
    from palu_trainer.framework.checks import ALLOW_OVERLAP, BadInput, forget_retain_overlap
    from palu_trainer.spans.format import AnnotationError

    @functools.wraps(get_data)
    def load(*args, **kwargs):
        try:
            data = get_data(*args, **kwargs)
        except AnnotationError as error:
            raise BadInput(str(error)) from None
        problem = forget_retain_overlap(data.get("train"), cfg.get("forget_split"), cfg.get("retain_split"))
        if problem and not cfg.get(ALLOW_OVERLAP, False):
            raise BadInput(problem)
        if problem:
            logger.warning("%s=true: %s", ALLOW_OVERLAP, problem)
        return data

    return load


def hub_hint(error: BaseException, environ=os.environ) -> str | None:
    """What to do when a mirrored hub dataset cannot be reached and its variable is unset (offline)."""
    text = str(error)
    for hub_id, variable in LOCAL_MIRRORS.items():
        if hub_id in text and not environ.get(variable):
            return (
                f"{hub_id} could not be loaded ({text.strip().splitlines()[0]}). Offline, set "
                f"{variable}=/path to a local copy of it (its JSON files and the hub README listing the "
                "configs)"
            )
    return None


def _precheck(prog: str, script: str, config_name: str, config_dir: Path, argv) -> None:
    """Refuse command-line and config mistakes before Hydra starts the job (and makes the output folder)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser

    from palu_trainer.framework.checks import argv_problem, config_problems

    problem = argv_problem(argv)
    if problem:
        sys.exit(f"{prog}: {problem}")
    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        return  # Hydra reports it
    if args.cfg or args.info or args.multirun or args.shell_completion or args.help or args.hydra_help:
        return
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            cfg = compose(args.config_name or config_name, overrides=args.overrides, return_hydra_config=True)
        problems = config_problems(cfg, script)
    except Exception:  # noqa: BLE001 (a config Hydra cannot compose: Hydra's own run reports it)
        return
    if problems:
        sys.exit("\n".join(f"{prog}: {problem}" for problem in problems))


def _run_framework_script(script: str, config_name: str) -> None:
    import hydra
    import torch
    from hydra.core.hydra_config import HydraConfig

    prog = Path(sys.argv[0]).name
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(usage(prog, script), end="")
        return
    sys.argv = [("--help" if arg == "--help-full" else arg) for arg in sys.argv]
    from palu_trainer.framework.run_stats import RUN_STATS_VARIABLE, with_run_stats

    src = ensure_importable()
    register()
    _precheck(prog, script, config_name, src.parent / "configs", sys.argv[1:])
    from palu_trainer.framework.checks import ALLOW_OTHER_DATA, BadInput, mid_epoch_warning

    module = importlib.import_module(script)
    framework_main = module.main.__wrapped__
    load_trainer = getattr(module, "load_trainer", None)  # train.py's; eval.py has none
    get_model, get_data = module.get_model, getattr(module, "get_data", None)

    @hydra.main(version_base=None, config_path=str(src.parent / "configs"), config_name=config_name)
    def main(cfg):
        runtime = HydraConfig.get().runtime.choices.get("runtime")
        problem = cpu_runtime_missing(runtime, torch.cuda.is_available())
        if problem:
            sys.exit(f"{prog}: {problem}")
        try:
            for line in redirect_to_local_mirrors(cfg):
                logger.info("local dataset mirror: %s", line)
        except FileNotFoundError as error:
            sys.exit(f"{prog}: {error}")
        module.get_model = _checking_vocabulary(get_model)
        if load_trainer is not None:
            args = cfg.trainer.args
            try:
                checkpoint = checkpoint_to_resume(args.get("resume_from_checkpoint"), args.output_dir)
            except (FileNotFoundError, ValueError) as error:
                sys.exit(f"{prog}: {error}")
            model_path = cfg.model.model_args.get("pretrained_model_name_or_path")
            if checkpoint and model_path and Path(model_path).resolve() == Path(checkpoint).resolve():
                sys.exit(
                    f"{prog}: resuming loads {checkpoint} itself; keep model.model_args."
                    "pretrained_model_name_or_path at the model unlearning started from (the reference)"
                )
            warning = checkpoint and mid_epoch_warning(checkpoint)
            if warning:
                logger.warning(warning)
            module.load_trainer = _resuming(load_trainer, checkpoint, bool(cfg.get(ALLOW_OTHER_DATA, False)))
            if os.environ.get(RUN_STATS_VARIABLE):  # make gpu-check: step times and peak memory
                module.load_trainer = with_run_stats(module.load_trainer)
            module.get_data = _checking_data(get_data, cfg)
        try:
            framework_main(cfg)
        except BadInput as error:
            sys.exit(f"{prog}: {error}")
        except Exception as error:
            hint = hub_hint(error)
            if hint:
                sys.exit(f"{prog}: {hint}")
            raise

    main()


def train_main() -> None:
    """`palu-train`: open-unlearning's train.py, with PALU registered and its configs visible."""
    _run_framework_script("train", "train.yaml")


def eval_main() -> None:
    """`palu-eval`: open-unlearning's eval.py, likewise."""
    _run_framework_script("eval", "eval.yaml")
