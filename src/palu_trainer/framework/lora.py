"""LoRA (peft) for every method palu-train runs, `+peft=lora` (docs/lora.md): adapters checked and added, the
reference the model with its adapters disabled (no second copy), the final save merged with the adapter."""

import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers.utils import ADAPTER_CONFIG_NAME

from palu_trainer.validation import Checked, Integer, Number, Options

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"  # beside the merged weights in the output folder
ADAPTER_NAME = "default"  # peft's name of the one adapter


def module_names(value):
    if isinstance(value, str) and value:
        return value
    names = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else ()
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError("a list of module names (q_proj, v_proj, ...) or all-linear")
    return names


class LoraSettings(Options):
    """The `peft` config node (`+peft=lora`)."""

    OWNER = "LoRA (+peft=lora)"

    r: Integer("the adapters' rank", ge=1) = 16
    alpha: Number("the update is scaled by alpha/r", gt=0) = 32.0
    dropout: Number("the share of the adapters' input dropped", ge=0, lt=1) = 0.05
    target_modules: Checked("peft's names: all-linear, or module name suffixes", module_names) = "all-linear"

    @classmethod
    def from_config(cls, node) -> "LoraSettings":
        return cls.parse(OmegaConf.to_container(node, resolve=True), "peft.")


def adapter_problem(model, settings: LoraSettings) -> str | None:
    """Why `settings` cannot put adapters on `model`, or None. Checked on the loaded model, before peft."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    head, modules = model.get_output_embeddings(), dict(model.named_modules())
    body = {name: m for name, m in modules.items() if isinstance(m, torch.nn.Linear) and m is not head}
    if settings.target_modules == "all-linear":  # peft's rule: every linear layer but the output projection
        targeted = body
    else:
        config = LoraConfig(target_modules=list(settings.target_modules))
        targeted = {
            name: m for name, m in modules.items() if name and check_target_module_exists(config, name)
        }
    layer_names = sorted({name.rsplit(".", 1)[-1] for name in body})
    if not targeted:
        return (
            f"peft.target_modules={list(settings.target_modules)} matches no module of "
            f"{model.config.model_type}: its linear layers are named {', '.join(layer_names)} (name some of "
            "them, or all-linear)"
        )
    for name, module in targeted.items():
        if module is head:
            return (
                f"peft.target_modules puts LoRA on the output projection ({name}): the reference and PALU's "
                f"projection read it unadapted; target the body's layers ({', '.join(layer_names)})"
            )
        if not isinstance(module, torch.nn.Linear):
            return (
                f"peft.target_modules matches {name}, a {type(module).__name__}: LoRA here adapts linear "
                f"layers only ({', '.join(layer_names)})"
            )
        width = min(module.in_features, module.out_features)
        if settings.r > width:
            return (
                f"peft.r={settings.r} is above the width of {name} ({module.in_features} -> "
                f"{module.out_features}, rank at most {width}): lower peft.r"
            )
    return None


def add_adapters(model, settings: LoraSettings):
    """A peft model of `model` with LoRA adapters (check `adapter_problem` first), its base weights frozen."""
    from peft import LoraConfig, get_peft_model

    targets = settings.target_modules
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets if isinstance(targets, str) else list(targets),
        task_type="CAUSAL_LM",
    )
    adapted = get_peft_model(model, config)
    # peft's model takes no gradient through its frozen embeddings: reentrant checkpointing would then
    # recompute every block without gradients and the adapters would never train (open-unlearning #178)
    adapted.enable_input_require_grads()
    trainable, total = adapted.get_nb_trainable_parameters()
    logger.info(
        "LoRA r=%d, alpha=%g, dropout=%g on %s: %d trainable parameters of %d (%.3f%%)",
        settings.r,
        settings.alpha,
        settings.dropout,
        targets,
        trainable,
        total,
        100 * trainable / total,
    )
    return adapted


def is_adapted(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def base_model(model):
    """The transformers model under a peft model's adapters, or the model itself."""
    return model.get_base_model() if is_adapted(model) else model


def adapters_disabled(model):
    """`model` computes as its base weights inside this block (a no-op for a model without adapters)."""
    return model.disable_adapter() if is_adapted(model) else contextlib.nullcontext()


class AdaptersDisabled:
    """The reference of a LoRA run: the trained model with its adapters disabled, in eval mode and without
    gradients, which computes exactly as the weights unlearning started from (the base weights are frozen).
    Called as the framework calls a reference model; other attributes are the model's."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        was_training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model), torch.no_grad():
                return self.model(*args, **kwargs)
        finally:
            self.model.train(was_training)

    def eval(self):
        return self

    def __getattr__(self, name):
        return getattr(self.model, name)


def merged_state_dict(state_dict: dict, model) -> dict:
    """The base model's state dict with every adapter merged into its layer: W + (alpha/r)·B·A.
    `state_dict` is the peft model's, full (gathered under ZeRO-3); `model` the peft model (where its
    adapters are and their scales)."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    merged = {
        key.removeprefix(prefix).replace(".base_layer.", "."): value
        for key, value in state_dict.items()
        if ".lora_" not in key
    }
    layers = {name.removeprefix(prefix): m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, layer in layers.items():
        weight = merged[f"{name}.weight"]
        down = state_dict[f"{prefix}{name}.lora_A.{ADAPTER_NAME}.weight"].float()
        up = state_dict[f"{prefix}{name}.lora_B.{ADAPTER_NAME}.weight"].float()
        update = layer.scaling[ADAPTER_NAME] * (up @ down)
        if layer.fan_in_fan_out:
            update = update.T
        merged[f"{name}.weight"] = (weight.float() + update.to(weight.device)).to(weight.dtype)
    return merged


def adapter_checkpoint_base(path) -> str | None:
    """The base model named in a LoRA run's checkpoint (a folder with the adapter and no model); None for any
    other folder or name. ValueError when its adapter_config.json cannot be read or names no base."""
    if not isinstance(path, str) or not path:
        return None
    folder = Path(path).expanduser()
    config = folder / ADAPTER_CONFIG_NAME
    if not config.is_file() or (folder / "config.json").is_file():
        return None
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise ValueError(f"{config}: not a readable adapter config ({error})") from error
    if not isinstance(base, str) or not base:
        raise ValueError(
            f"{config} names no base model (base_model_name_or_path): evaluate the run's final folder, "
            "which holds the merged weights, or set it to the model the run started from"
        )
    return base
