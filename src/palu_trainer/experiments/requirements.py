"""What the real recipe needs from the machine, each lack told with what to do: GPUs, FlashAttention-2 where
a model config asks for it, model and tokenizer access on the hub (gated Llama), the dataset, the retain and
Original models' evaluation logs, DPO's answers."""

import importlib
import importlib.util
import os
from pathlib import Path

from palu_trainer.framework.checkout import CONFIG_DIR, checkout_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")  # any of them in MODEL_DIR
FLASH_ATTN_INSTALL = (
    "`make flash-attn` (MAX_JOBS=4 pip install flash-attn --no-build-isolation; needs the CUDA toolkit)"
)


def model_config(name: str) -> dict:
    """The model config `model=<name>` composes: the framework's configs/model/<name>.yaml, or this
    plugin's; empty if neither has it."""
    import yaml

    for directory in (checkout_dir() / "configs" / "model", CONFIG_DIR / "model"):
        path = directory / f"{name}.yaml"
        if path.is_file():
            return yaml.safe_load(path.read_text()) or {}
    return {}


def flash_attention_problem() -> str | None:
    """Why `attn_implementation=flash_attention_2` cannot run here, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed"
    try:
        importlib.import_module("flash_attn")
    except Exception as error:  # a wheel built for another torch or CUDA fails here, not at find_spec
        return f"flash-attn does not import ({type(error).__name__}: {error})"
    return None


def choose_attention(model: str, requested: str = "auto") -> tuple[str | None, list[str], list[str]]:
    """(the attention override for every run or None for the config's own, warnings, problems).

    `auto`: the model config's attention, except flash_attention_2 without a working flash-attn, which
    becomes sdpa with a warning (the framework's Llama and Qwen configs all ask for flash_attention_2).
    An explicit `flash_attention_2` that cannot run is a problem; any other explicit value is used as is.
    """
    configured = model_config(model).get("model_args", {}).get("attn_implementation")
    wanted = configured if requested == "auto" else requested
    if wanted != "flash_attention_2" or (problem := flash_attention_problem()) is None:
        return (None if wanted == configured else wanted), [], []
    if requested == "flash_attention_2":
        asked = f"attn_implementation={wanted} asked for, but {problem}"
        return wanted, [], [f"{asked}: run {FLASH_ATTN_INSTALL}, or ATTN=sdpa"]
    warning = (
        f"model config {model} asks for flash_attention_2, but {problem}: every run uses "
        "model.model_args.attn_implementation=sdpa instead (the same model, numerically close, slower and "
        f"more memory on long sequences). For FlashAttention-2: {FLASH_ATTN_INSTALL} on the GPU machine"
    )
    return "sdpa", [warning], []


def missing_requirements(
    settings, environ=os.environ, needs_original_logs=False, needs_idk_answers=False
) -> list[str]:
    """What this machine lacks for the real recipe of `settings` (a `recipe.RecipeSettings`), each with what
    to do; empty when ready."""
    import torch

    eval_logs = f"run `python setup_data.py --eval_logs` in {checkout_dir()} (its saves/eval is read from "
    eval_logs += "there or here)"
    problems = []
    if needs_idk_answers and not Path(settings.idk_answers_path).is_file():
        problems.append(
            f"{settings.idk_answers_path} not found (DPO's \"I don't know\" answers): run "
            f"`python setup_data.py --idk` in {checkout_dir()}, or set IDK_ANSWERS to a file with one answer "
            "per line"
        )
    if needs_original_logs and not Path(settings.original_logs_path).is_file():
        problems.append(
            f"Original model logs {settings.original_logs_path} not found (the comparison table's Original "
            f"row): {eval_logs}, or evaluate the target as the framework's scripts/tofu_finetune.sh does, or "
            "set ORIGINAL_LOGS"
        )
    if torch.cuda.device_count() < settings.gpus:
        problems.append(
            f"{settings.gpus} CUDA GPU(s) needed, {torch.cuda.device_count()} visible: the recipe "
            f"fine-tunes a {settings.model} model"
        )
    if settings.model_dir:
        if not (Path(settings.model_dir) / "config.json").is_file():
            problems.append(
                f"MODEL_DIR={settings.model_dir} has no config.json (save_pretrained weights expected)"
            )
        if not any((Path(settings.model_dir) / name).is_file() for name in TOKENIZER_FILES):
            problems.append(
                f"MODEL_DIR={settings.model_dir} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): the "
                "recipe loads the tokenizer from it too; save it there with tokenizer.save_pretrained"
            )
    elif not (config := model_config(settings.model)):
        problems.append(
            f"no model config {settings.model}.yaml in {checkout_dir() / 'configs' / 'model'} or "
            f"{CONFIG_DIR / 'model'}: MODEL= names one of the framework's model configs"
        )
    else:  # the config's tokenizer: a gated meta-llama/* id for the framework's Llama configs
        tokenizer_id = config.get("tokenizer_args", {}).get("pretrained_model_name_or_path")
        model = hub_problem(settings.model_path, "model", "config.json", environ)
        tokenizer = hub_problem(tokenizer_id, "tokenizer", "tokenizer_config.json", environ)
        problems += [problem for problem in (model, tokenizer) if problem]
    problems.extend(settings.dataset_problems(environ))
    if not Path(settings.retain_logs_path).is_file():
        problems.append(
            f"retain model logs {settings.retain_logs_path} not found (forget quality / privleak need them): "
            f"{eval_logs}, or set RETAIN_LOGS"
        )
    return problems


def hub_problem(repo_id: str | None, what: str, filename: str, environ=os.environ) -> str | None:
    """None when `filename` of `repo_id` (a model or tokenizer) is in the Hugging Face cache or the hub serves
    it to this machine's token (a HEAD request: no weights move), else what is wrong and what to do. Gated
    repositories (meta-llama/*, the framework's Llama tokenizers) need a login that accepted the licence."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if not repo_id or Path(repo_id).is_dir():
        return None if repo_id else f"{what}: no pretrained_model_name_or_path in the model config"
    if isinstance(try_to_load_from_cache(repo_id, filename), str):
        return None
    login = (
        "run `huggingface-cli login` with a token of an account that has access (if gated, accept its "
        f"licence at https://huggingface.co/{repo_id})"
    )
    local, name = "or set MODEL_DIR to local weights saved with their tokenizer", f"{what} {repo_id}"
    if environ.get("HF_HUB_OFFLINE") == "1":
        return f"{name}: not in the Hugging Face cache and HF_HUB_OFFLINE=1; online, {login}; {local}"
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename), timeout=10)
    except GatedRepoError:
        return f"{name} is gated and this machine's token has no access: {login}; {local}"
    except RepositoryNotFoundError:
        return f"{name}: not on the hub for this machine's token (private or gated?): {login}; {local}"
    except Exception as error:  # offline, DNS failure, timeout
        unreachable = f"the hub is unreachable ({type(error).__name__})"
        return f"{name}: not in the Hugging Face cache and {unreachable}; online, {login}; {local}"
    return None


def dataset_on_hub_or_cached(repo_id: str) -> bool:
    """Whether the hub's dataset `repo_id` is in the cache, or the hub serves it to this machine now."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "README.md", repo_type="dataset"), str):
        return True
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        HfApi().repo_info(repo_id, repo_type="dataset", timeout=5)
        return True
    except Exception:  # offline, DNS failure, gated: all mean "cannot fetch it now"
        return False
