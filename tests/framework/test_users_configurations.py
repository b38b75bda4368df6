"""One GPU in bf16, as users run it, on the CPU: the same batches in bf16 and in fp32 give the same losses.

On CUDA the framework's model configs load Llama in `torch_dtype: bfloat16` and its trainer args set
`bf16: true`; accelerate then wraps `model.forward` in autocast and converts its outputs to fp32, while the
Trainer's own `compute_loss` runs outside autocast. On the CPU the Trainer would put `compute_loss` under
autocast too (`use_cpu_amp`), which hides what CUDA users see; these runs switch that off, so the losses run
exactly as on one GPU. The model: |V| = 32000 (Llama-2's), tied and untied output embeddings, gradient
checkpointing on, real TOFU rows with the GPT-4o spans plus a row without spans. The LoRA row (`+peft=lora`)
trains fp32 adapters on the bf16 model against the model with its adapters disabled.
"""

import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from palu_lab.trainer_config import tokenizer_keyword
from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.framework.lora import AdaptersDisabled, LoraSettings, add_adapters
from palu_trainer.framework.patches.adapters import reference_without_copy
from palu_trainer.spans.tpo_spans import read_tpo

from ..conftest import TAG_TEMPLATE, read_jsonl, tied_and_untied_models
from .test_datasets import span_dataset

ensure_importable()
from data.unlearn import ForgetRetainDataset  # noqa: E402

from palu_trainer.framework.datasets import DataCollatorWithTokenRoles  # noqa: E402
from palu_trainer.framework.trainers.palu import PALUTrainer  # noqa: E402
from palu_trainer.framework.trainers.tpo import TPOTrainer  # noqa: E402

USERS_VOCABULARY = 32000
pytestmark = pytest.mark.stack
STEPS = 3
# bf16 keeps 8 significant bits: weights, activations and logits are each rounded to 2**-8 relative, and a
# loss averages hundreds of such logits, so the bf16 run's losses land within a few 2**-8 of the fp32 run's.
# The KL starts at exactly 0 in both and stays below 1e-2, where the relative error is meaningless: absolute.
BF16_RELATIVE = 4 * 2**-8
BF16_KL_ABSOLUTE = 2e-3
METHODS = {
    "PALU-reference-cache": (PALUTrainer, {"top_k": 0.15625, "reference_cache": True}),
    "PALU-reference-model": (PALUTrainer, {"top_k": 0.15625, "reference_cache": False}),
    "TPO": (TPOTrainer, {"beta": 0.32}),
    # +peft=lora: adapters in fp32 on the bf16 model, the reference the model with its adapters disabled
    "PALU-reference-model-LoRA": (PALUTrainer, {"top_k": 0.15625, "reference_cache": False}),
    "TPO-LoRA": (TPOTrainer, {"beta": 0.32}),
}


@pytest.fixture(scope="module")
def users_model_dirs(tmp_path_factory, tofu_rows):
    """|V| = 32000 Llamas, tied and untied."""
    return tied_and_untied_models(tmp_path_factory, tofu_rows, USERS_VOCABULARY)


@pytest.fixture(scope="module")
def forget_rows_and_spans(tofu_dir, shared_dir):
    """Three TOFU forget01 rows with their GPT-4o spans and one row with none (no initiating token)."""
    rows = read_jsonl(tofu_dir / "forget01.json")[:4]
    _, spans = read_tpo(shared_dir / "data" / "tofu_spans_gpt4o" / "forget01.jsonl")
    return rows, [*spans[:3], []]


def train(model_dir, method, bf16, forget_rows_and_spans, retain_row, tmp_path, monkeypatch):
    """Three steps of `method` on batches of two forget rows; the per-step log entries."""
    # TrainingArguments(bf16=True) exports the precision for accelerate and nothing unsets it
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    trainer_class, method_args = METHODS[method]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.bfloat16 if bf16 else torch.float32
    )
    lora = method.endswith("LoRA")
    if lora:
        model = add_adapters(model, LoraSettings(dropout=0.0))
    rows, spans = forget_rows_and_spans
    for part in ("forget", "retain"):
        (tmp_path / part).mkdir(parents=True)
    forget = span_dataset(tmp_path / "forget", tokenizer, TAG_TEMPLATE, rows, spans, n=3)
    retain = span_dataset(
        tmp_path / "retain", tokenizer, TAG_TEMPLATE, [retain_row], [[]], min_initiating_tokens=0
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        remove_unused_columns=False,
        bf16=bf16,
        gradient_checkpointing=True,
        seed=0,
    )
    AcceleratorState._reset_state()  # a process-wide singleton: else the previous run's precision stays
    with reference_without_copy():
        trainer = trainer_class(
            model=model,
            args=args,
            train_dataset=ForgetRetainDataset(forget=forget, retain=retain),
            **tokenizer_keyword(tokenizer),
            data_collator=DataCollatorWithTokenRoles(tokenizer, index="index"),
            template_args=TAG_TEMPLATE,
            **method_args,
        )
    assert isinstance(trainer.ref_model, AdaptersDisabled) == lora
    trainer.use_cpu_amp = False  # as on CUDA: mixed precision only through accelerate's wrapped forward
    trainer.train()
    assert trainer.args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert trainer.accelerator.native_amp == bf16
    assert trainer.model.dtype == (torch.bfloat16 if bf16 else torch.float32)
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("method", list(METHODS))
def test_bf16_on_one_gpu_trains_as_fp32_does(
    method, tied, users_model_dirs, forget_rows_and_spans, tofu_dir, tmp_path, monkeypatch
):
    retain_row = read_jsonl(tofu_dir / "retain99.json")[0]
    model_dir = users_model_dirs[tied]
    assert AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size == USERS_VOCABULARY
    runs = {
        bf16: train(
            model_dir, method, bf16, forget_rows_and_spans, retain_row, tmp_path / str(bf16), monkeypatch
        )
        for bf16 in (False, True)
    }
    assert len(runs[True]) == len(runs[False]) == STEPS
    terms = ("loss", "local_loss", "retain_loss") if method.startswith("PALU") else ("loss",)
    for step, (fp32, bf16) in enumerate(zip(runs[False], runs[True])):
        for term in terms:
            print(f"step {step} {term}: fp32 {fp32[term]:.6f}, bf16 {bf16[term]:.6f}")
            assert bf16[term] == pytest.approx(fp32[term], rel=BF16_RELATIVE), (step, term)
        if method.startswith("PALU"):
            assert fp32["n_initiating"] == bf16["n_initiating"]
            assert bf16["kl_loss"] == pytest.approx(fp32["kl_loss"], abs=BF16_KL_ABSOLUTE), step
    if method.startswith("PALU"):
        assert sum(entry["n_initiating"] for entry in runs[True]) > 0
        assert max(entry["local_loss"] for entry in runs[True]) > 0


def test_gradient_checkpointing_recomputes_without_reentrant_passes_unless_told(tmp_path):
    """Reentrant checkpointing gives each parameter two gradients per step (forget and retain forwards),
    which ZeRO-3 reduces separately: a wrong step (tests/framework/test_distributed.py measures it)."""
    from palu_trainer.framework.trainers.guarded import use_non_reentrant_checkpointing

    def arguments(**options):
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **options)
        use_non_reentrant_checkpointing(args)
        return args.gradient_checkpointing_kwargs

    assert arguments(gradient_checkpointing=True) == {"use_reentrant": False}
    assert arguments(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}) == {
        "use_reentrant": True
    }
    assert arguments(gradient_checkpointing=False) is None
