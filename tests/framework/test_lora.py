"""LoRA (`+peft=lora`): settings and adapters checked before training, adapters that train under gradient
checkpointing, a reference that is the same model with its adapters disabled, and a final save of merged
weights that loads as a plain model."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.framework.lora import (
    ADAPTER_DIR,
    AdaptersDisabled,
    LoraSettings,
    adapter_problem,
    add_adapters,
)
from palu_trainer.framework.patches.adapters import (
    merging_adapter_checkpoints,
    reference_without_copy,
    saving_merged,
)

from ..conftest import tied_and_untied_models
from .test_bad_inputs import QUICK_RUN, run

ensure_importable()
from trainer.unlearn.npo import NPO  # noqa: E402


@pytest.fixture(scope="module")
def tied_and_untied(tmp_path_factory, tofu_rows):
    return tied_and_untied_models(tmp_path_factory, tofu_rows, 2048)


def settings(**values) -> LoraSettings:
    return LoraSettings.from_config(OmegaConf.create(values))


def randomize_adapters(model, seed=0):
    """Adapters as after training: peft starts lora_B at zero, where the adapted model is the base."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


def logits(model, input_ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rank": 8}, "peft.rank is not an option of LoRA (+peft=lora): its options are alpha, dropout, r, "),
        ({"r": 0}, "peft.r=0: must be an integer >= 1 (the adapters' rank)"),
        ({"r": 8.5}, "peft.r=8.5: must be an integer >= 1"),
        ({"r": True}, "peft.r=True: must be an integer >= 1"),
        ({"alpha": 0}, "peft.alpha=0: must be a number > 0"),
        ({"dropout": 1.0}, "peft.dropout=1.0: must be a number >= 0 and < 1"),
        ({"dropout": "0.1"}, "peft.dropout='0.1': must be a number >= 0"),
        ({"target_modules": []}, "peft.target_modules=[]: a list of module names"),
        ({"target_modules": 3}, "peft.target_modules=3: a list of module names"),
    ],
)
def test_settings_are_refused_with_the_key_and_what_it_takes(values, message):
    with pytest.raises(ValueError) as error:
        settings(**values)
    assert message in str(error.value)


def test_the_shipped_config_is_the_default_settings():
    from palu_trainer.framework.checkout import CONFIG_DIR

    shipped = LoraSettings.from_config(OmegaConf.load(CONFIG_DIR / "peft" / "lora.yaml").peft)
    assert shipped == LoraSettings()
    assert shipped.target_modules == "all-linear"


def test_adapters_that_cannot_fit_the_model_are_named(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    hidden = model.config.hidden_size
    names = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    assert adapter_problem(model, settings(target_modules=["query_key_value"])) == (
        "peft.target_modules=['query_key_value'] matches no module of llama: its linear layers are named "
        f"{names} (name some of them, or all-linear)"
    )
    widths = {module.out_features for name, module in model.named_modules() if name.endswith("k_proj")}
    (k_width,) = widths
    assert adapter_problem(model, settings(r=k_width + 1, target_modules=["k_proj"])) == (
        f"peft.r={k_width + 1} is above the width of model.layers.0.self_attn.k_proj ({hidden} -> {k_width}, "
        f"rank at most {k_width}): lower peft.r"
    )
    assert "on the output projection (lm_head)" in adapter_problem(
        model, settings(target_modules=["lm_head"])
    )
    assert adapter_problem(model, settings(r=k_width, target_modules=["k_proj"])) is None
    assert adapter_problem(model, LoraSettings()) is None


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_adapters_train_under_reentrant_gradient_checkpointing(tied, tied_and_untied):
    """open-unlearning #178: with reentrant checkpointing and frozen embeddings, the recomputed blocks had
    no gradient and the adapters never trained. Every adapter gets a gradient here, the base none."""
    model = add_adapters(AutoModelForCausalLM.from_pretrained(tied_and_untied[tied]), LoraSettings())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    input_ids = torch.arange(2, 18).reshape(2, 8)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    lora_b = {name: p for name, p in trained.items() if "lora_B" in name}
    assert len(lora_b) == 7 * model.config.num_hidden_layers  # every linear layer of every block
    missing = [name for name, p in lora_b.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    assert all(p.grad is None for name, p in model.named_parameters() if not p.requires_grad)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_reference_is_the_base_model_with_no_second_copy(tied, tied_and_untied, make_trainer):
    base = AutoModelForCausalLM.from_pretrained(tied_and_untied[tied])
    input_ids = torch.arange(2, 18).reshape(2, 8)
    expected = logits(base, input_ids)
    model = add_adapters(base, LoraSettings())
    with reference_without_copy():
        trainer = make_trainer(model=model, trainer_class=NPO, beta=0.1)
    reference = trainer.ref_model
    assert isinstance(reference, AdaptersDisabled) and reference.model is trainer.model
    randomize_adapters(model)
    model.train()
    assert torch.equal(reference(input_ids=input_ids).logits, expected)
    assert model.training  # the view switched to eval for its call only
    assert not torch.allclose(logits(model, input_ids), expected, atol=1e-3)  # the adapters do act
    # outside the block, the framework's deep copy again
    assert NPO._prepare_ref_model.__qualname__ == "GradDiff._prepare_ref_model"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_final_save_is_the_merged_model_with_its_adapter_beside_it(
    tied, tied_and_untied, make_trainer, tmp_path
):
    model_dir = tied_and_untied[tied]
    model = add_adapters(AutoModelForCausalLM.from_pretrained(model_dir), settings(alpha=8, r=4))
    with reference_without_copy():
        trainer = saving_merged(make_trainer(model=model, trainer_class=NPO, beta=0.1))
    randomize_adapters(model)
    input_ids = torch.arange(2, 18).reshape(2, 8)
    adapted = logits(model, input_ids)
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (out / ADAPTER_DIR).iterdir()
    }
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.config.tie_word_embeddings == tied
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, input_ids), adapted, atol=1e-4, rtol=1e-4)
    before = logits(AutoModelForCausalLM.from_pretrained(model_dir), input_ids)
    assert not torch.allclose(logits(merged, input_ids), before, atol=1e-3)
    assert len(AutoTokenizer.from_pretrained(out)) == len(AutoTokenizer.from_pretrained(model_dir))
    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out / ADAPTER_DIR)
    torch.testing.assert_close(logits(reloaded, input_ids), adapted, atol=1e-4, rtol=1e-4)
    # a checkpoint stays transformers' own: the adapter, which resuming loads
    checkpoint = tmp_path / "checkpoint"
    trainer.save_model(str(checkpoint), _internal_call=True)
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (
        checkpoint / "model.safetensors"
    ).exists()
    # which palu-eval loads through the framework's get_model as its base with the adapter merged, in eval
    # mode (transformers alone would attach it unmerged, its dropout in training mode)
    from model import get_model

    model_cfg = OmegaConf.create(
        {
            args: {"pretrained_model_name_or_path": str(checkpoint)}
            for args in ("model_args", "tokenizer_args")
        }
    )
    model_cfg.tokenizer_args.pretrained_model_name_or_path = str(model_dir)
    loaded, _ = merging_adapter_checkpoints(get_model)(model_cfg)
    assert not any(module.training for module in loaded.modules())
    assert not any("lora" in name for name, _ in loaded.named_parameters())
    torch.testing.assert_close(logits(loaded, input_ids), adapted, atol=1e-4, rtol=1e-4)


def test_a_lora_checkpoint_on_a_lora_checkpoint_loads_both_adapters(tiny_model_dir, tmp_path):
    """A run that starts from a LoRA checkpoint (merged on loading) trains new adapters; its own checkpoint
    names the first checkpoint as its base, and loading it merges both adapters, in order."""
    from model import get_model

    def load(path):
        cfg = {"model_args": {"pretrained_model_name_or_path": str(path)}}
        cfg["tokenizer_args"] = {"pretrained_model_name_or_path": str(tiny_model_dir)}
        return merging_adapter_checkpoints(get_model)(OmegaConf.create(cfg))[0]

    input_ids = torch.arange(2, 18).reshape(2, 8)
    first = add_adapters(AutoModelForCausalLM.from_pretrained(tiny_model_dir), settings(r=4))
    randomize_adapters(first, seed=1)
    first.save_pretrained(tmp_path / "first")
    second = add_adapters(load(tmp_path / "first"), settings(r=4))
    randomize_adapters(second, seed=2)
    second.save_pretrained(tmp_path / "second")
    assert json.loads((tmp_path / "second" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(tmp_path / "first")
    both = logits(second, input_ids)
    torch.testing.assert_close(logits(load(tmp_path / "second"), input_ids), both, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits(load(tmp_path / "first"), input_ids), both, atol=1e-3)


def test_a_lora_checkpoint_is_a_model_path_while_its_base_model_is_there(tmp_path, tiny_model_dir):
    from palu_trainer.framework.model_paths import model_path_problem

    checkpoint = tmp_path / "run" / "checkpoint-5"
    checkpoint.mkdir(parents=True)

    def problem(base):
        config = {} if base is None else {"base_model_name_or_path": base}
        (checkpoint / "adapter_config.json").write_text(json.dumps(config))
        model = {"pretrained_model_name_or_path": str(checkpoint)}
        cfg = OmegaConf.create(
            {
                "model": {
                    "model_args": model,
                    "tokenizer_args": {"pretrained_model_name_or_path": tiny_model_dir},
                }
            }
        )
        return model_path_problem(cfg, "eval")

    assert problem(str(tiny_model_dir)) is None
    assert problem("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id: transformers fetches it
    key = f"model.model_args.pretrained_model_name_or_path={checkpoint}"
    assert problem(str(tmp_path / "moved")) == (
        f"{key} is a LoRA checkpoint (its adapter only), and its base model {tmp_path / 'moved'} "
        "(adapter_config.json: base_model_name_or_path) is not a saved model folder: put the model the run "
        "started from back there, or evaluate the run's final folder, which holds the merged weights"
    )
    assert problem(None).startswith(f"{key}: {checkpoint / 'adapter_config.json'} names no base model")
    (checkpoint / "adapter_config.json").write_text("{not json")
    cfg = OmegaConf.create({"model": {"model_args": {"pretrained_model_name_or_path": str(checkpoint)}}})
    assert model_path_problem(cfg, "eval").startswith(f"{key}: {checkpoint / 'adapter_config.json'}: not a")


def test_lora_for_a_module_reading_method_or_for_palu_eval_is_refused():
    from palu_trainer.framework.checks import peft_problem

    cfg = OmegaConf.create({"peft": {"r": 8}, "trainer": {"handler": "RMU"}})
    assert peft_problem(cfg, "train").startswith("trainer=RMU reads its reference model's modules by name")
    cfg.trainer.handler = "NPO"
    assert peft_problem(cfg, "train") is None
    assert peft_problem(cfg, "eval").startswith("+peft=lora is a training option")
    assert peft_problem(OmegaConf.create({"trainer": {"handler": "NPO"}}), "eval") is None


@pytest.mark.slow
def test_palu_train_names_target_modules_that_match_nothing_before_training(
    tmp_path, tiny_model_dir, tofu_mirror
):
    code, output = run(
        QUICK_RUN,
        ["+peft=lora", "peft.target_modules=[qkv]", "+trainer.args.max_steps=1"],
        tofu_mirror,
        tiny_model_dir,
        tmp_path,
    )
    assert code == 1
    assert (
        "palu-train: peft.target_modules=['qkv'] matches no module of llama: its linear layers are named "
        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (name some of them, or all-linear)"
    ) in output
    assert "reference cache" not in output and "Traceback" not in output
