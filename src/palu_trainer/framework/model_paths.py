"""Model and tokenizer paths checked before anything heavy is imported: a mistyped local path, a folder
that is no saved model, and a hub id that can be neither read from the Hugging Face cache nor downloaded
(offline). palu-train and palu-eval refuse them within a second of starting; the framework's own scripts
meet the same checks once their imports are done (the Hydra callback, and the model load for hub ids)."""

from pathlib import Path

from omegaconf import OmegaConf

from palu_trainer.training.run_lock import running_run

# transformers.utils.ADAPTER_CONFIG_NAME, which this module cannot import without importing torch
ADAPTER_CONFIG_NAME = "adapter_config.json"
MODEL_FILES = {"model_args": "config.json", "tokenizer_args": "tokenizer_config.json"}


def is_local_path(value: str) -> bool:
    """A model reference that names a folder here rather than a hub id."""
    return value.startswith((".", "/", "~")) or Path(value).expanduser().exists()


def hub_reachable() -> bool:
    """Whether the Hugging Face hub answers within a second and a half (HF_HUB_OFFLINE: no)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        socket.create_connection((urlparse(constants.ENDPOINT).hostname, 443), timeout=1.5).close()
    except OSError:
        return False
    return True


def hub_model_problem(key: str, value: str, file_name: str) -> str | None:
    """A hub id that is not in the local cache while the hub cannot be reached (offline), found in about a
    second instead of the hub client's retries and tracebacks (21 s, seven of them)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(value, file_name)
    except ValueError:  # not a valid repo id either
        return f"{key}={value}: no such folder, and not a hub id; give a saved model folder"
    if isinstance(cached, str) or hub_reachable():
        return None
    return (
        f"{key}={value} is not a local folder, not in the Hugging Face cache, and the hub cannot be reached "
        "(offline): give the path of a saved model folder (a mistyped path reads as a hub id), or download "
        "the model where the hub is reachable"
    )


def model_path_problem(cfg, script) -> str | None:
    """A local model or tokenizer folder that is not a saved model: missing, or an interrupted run's."""
    needs = {"model_args": ("config.json",), "tokenizer_args": ("tokenizer_config.json", "tokenizer.json")}
    for args, files in needs.items():
        key = f"model.{args}.pretrained_model_name_or_path"
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, str):
            continue
        if not is_local_path(value):
            if value.count("/") > 1:
                return f"{key}={value}: no such folder (a hub id is owner/name); give a saved model folder"
            continue  # a hub id: `hub_model_problem`
        path = Path(value).expanduser()
        if not path.is_dir():
            return f"{key}={value}: no such folder; give a saved model folder or a hub id"
        if running := running_run(path):
            return (
                f"{key}={value} belongs to a run that is still going ({running}): its final model is saved "
                "last; evaluate the folder once that run has finished"
            )
        from palu_trainer.training.run_folder import failed_run_problem

        if failed := failed_run_problem(key, path):
            return failed
        if any((path / name).is_file() for name in files):
            continue
        if args == "model_args" and (path / ADAPTER_CONFIG_NAME).is_file():
            # a LoRA run's checkpoint (its adapter only) loads onto the base model its adapter config names
            from palu_trainer.framework.lora import adapter_checkpoint_base

            try:
                base = adapter_checkpoint_base(value)
            except ValueError as error:
                return f"{key}={value}: {error}"
            if is_local_path(base) and not (Path(base).expanduser() / "config.json").is_file():
                return (
                    f"{key}={value} is a LoRA checkpoint (its adapter only), and its base model {base} "
                    f"({ADAPTER_CONFIG_NAME}: base_model_name_or_path) is not a saved model folder: put the "
                    "model the run started from back there, or evaluate the run's final folder, which holds "
                    "the merged weights"
                )
            continue
        checkpoints = sorted(path.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1] or 0))
        if checkpoints:
            return (
                f"{key}={value} is an interrupted run's folder: it holds checkpoints but no final model "
                f"(no {files[0]}). Use a checkpoint, e.g. {key}={checkpoints[-1]}, or finish the run "
                f"(+trainer.args.resume_from_checkpoint={checkpoints[-1]})"
            )
        return f"{key}={value}: no {files[0]} there, so it is not a saved model or tokenizer folder"
    return None


def model_problems(cfg, script: str) -> str | None:
    """`model_path_problem`, then `hub_model_problem` for a hub id: what palu-train and palu-eval check
    on the composed config before their heavy imports."""
    if problem := model_path_problem(cfg, script):
        return problem
    for part, file_name in MODEL_FILES.items():
        key = f"model.{part}.pretrained_model_name_or_path"
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str) and not is_local_path(value):
            if problem := hub_model_problem(key, value, file_name):
                return problem
    return None


def command_line_model_problem(argv, script: str) -> str | None:
    """`model_problems` of the model and tokenizer paths that the command line sets, in a fraction of a
    second: before Hydra composes the whole config (a second or more), which the others need."""
    given = {}
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        part = key.removeprefix("model.").removesuffix(".pretrained_model_name_or_path")
        if part in MODEL_FILES and key == f"model.{part}.pretrained_model_name_or_path" and "${" not in value:
            given[part] = {"pretrained_model_name_or_path": value}
    return model_problems(OmegaConf.create({"model": given}), script) if given else None
