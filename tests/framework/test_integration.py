"""palu-train runs open-unlearning's own train.py, for PALU and for a stock baseline."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from palu_trainer.spans.tpo_spans import import_tpo

from ..conftest import EVAL_ROWS

PALU_TRAIN = Path(sys.executable).parent / "palu-train"
MODEL_ARGS = ("model_args", "tokenizer_args")
QUICK_RUN = [
    "--config-name=unlearn.yaml",
    "+runtime=cpu",
    "model=tiny-llama",
    "forget_split=forget01",
    "retain_split=retain99",
    "holdout_split=holdout01",
    "+trainer.args.max_steps=4",
    "trainer.args.per_device_train_batch_size=4",
    "trainer.args.gradient_accumulation_steps=1",
    "trainer.args.logging_steps=1",
    "trainer.args.learning_rate=1e-3",
    "trainer.args.do_eval=false",
    "trainer.args.eval_on_start=false",
    "trainer.args.eval_strategy=no",
    "trainer.args.report_to=none",
]


def palu_train(overrides, tofu_mirror, model_dir, out_dir):
    env = {**os.environ, "TOFU_DIR": str(tofu_mirror)}
    command = [str(PALU_TRAIN), *QUICK_RUN, f"paths.output_dir={out_dir}", *overrides]
    command += [
        f"model.{args}.pretrained_model_name_or_path={model_dir}" for args in ("model_args", "tokenizer_args")
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads((out_dir / "trainer_state.json").read_text())[
        "log_history"
    ], result.stdout + result.stderr


def changed_tensors(model_dir, out_dir):
    before, after = load_file(model_dir / "model.safetensors"), load_file(out_dir / "model.safetensors")
    return [name for name in before if not before[name].equal(after[name])]


@pytest.mark.parametrize("trainer", ["PALU", "PALU_release"])
@pytest.mark.slow
def test_palu_through_the_framework_train_py(tmp_path, tiny_model_dir, tofu_mirror, shared_dir, trainer):
    annotations = tmp_path / "forget01.jsonl"
    import_tpo(shared_dir / "data" / "tofu_spans_gpt4o" / "forget01.jsonl", annotations)
    out = tmp_path / "palu"
    history, output = palu_train(
        [
            "experiment=unlearn/tofu/palu",
            f"trainer={trainer}",
            "task_name=palu_it",
            f"span_annotations={annotations}",
        ],
        tofu_mirror,
        tiny_model_dir,
        out,
    )
    steps = [entry for entry in history if "local_loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2, 3, 4]
    for entry in steps:
        assert all(math.isfinite(entry[key]) for key in ("loss", "local_loss", "kl_loss", "retain_loss"))
        assert entry["local_loss"] > 0 and entry["retain_loss"] > 0
        assert entry["n_initiating"] > 0 and entry["n_common"] > 0 and entry["n_redundant"] >= 0
    # The first step's model is the reference: KL on common tokens is zero, then grows.
    assert steps[0]["kl_loss"] == 0.0 and steps[-1]["kl_loss"] > 0
    assert "top_k=0.15625: K=320 of |V|=2048" in output  # the paper's share of the vocabulary
    merged = "adjacent spans merged" in output
    assert merged == (trainer == "PALU_release"), "the release preset merges spans in the forget dataset"
    assert "local dataset mirror: data.forget.TOFU_QA_forget_spans" in output
    assert len(changed_tensors(tiny_model_dir, out)) > 10
    print("PALU log lines:", *steps, sep="\n")


METHOD_RUNS = {
    "PALU": ["experiment=unlearn/tofu/palu", "trainer=PALU"],
    "TPO": ["experiment=unlearn/tofu/tpo"],
    "NPO": ["experiment=unlearn/tofu/default", "trainer=NPO"],
}
# LoRA with gradient checkpointing: the stock NPO checkpoints reentrantly, where adapters that get no
# gradient (open-unlearning #178) would leave the merged weights equal to the model's
LORA = ["+peft=lora", "trainer.args.gradient_checkpointing=true"]
METHOD_RUNS |= {
    "PALU-LoRA": [*METHOD_RUNS["PALU"], *LORA, "trainer.method_args.reference_cache=false"],
    "NPO-LoRA": [*METHOD_RUNS["NPO"], *LORA],
}


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("method", list(METHOD_RUNS))
def test_train_then_evaluate_on_this_stack(tmp_path, tiny_model_dir, small_tofu_mirror, shared_dir, method):
    """palu-train, then palu-eval with the stock TOFU evaluator on the result, for each method."""
    spans = tmp_path / "forget01.jsonl"
    import_tpo(shared_dir / "data" / "tofu_spans_gpt4o" / "forget01.jsonl", spans)
    spans.write_text("".join(spans.read_text().splitlines(keepends=True)[:EVAL_ROWS]))
    out = tmp_path / "run"
    spanned = [f"span_annotations={spans}"] if not method.startswith("NPO") else []
    history, output = palu_train(
        [*METHOD_RUNS[method], *spanned, f"task_name={method}_e2e", "++trainer.args.max_steps=2"],
        small_tofu_mirror,
        tiny_model_dir,
        out,
    )
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), history
    changed = changed_tensors(tiny_model_dir, out)
    assert len(changed) > 10
    if method.endswith("LoRA"):  # the merged weights: the adapted layers moved, nothing else
        assert all(name.endswith("proj.weight") for name in changed), changed
        assert (out / "adapter" / "adapter_model.safetensors").is_file()
        assert "reference: the model with its LoRA adapters disabled (no second copy)" in output
    if "trainer.method_args.reference_cache=false" in METHOD_RUNS[method]:
        assert "reference cache:" not in output
    evaluation = [
        str(PALU_TRAIN.parent / "palu-eval"),
        "experiment=eval/tofu/tiny",
        "+runtime=cpu",
        "forget_split=forget01",
        "holdout_split=holdout01",
        "max_new_tokens=8",
        f"task_name={method}_eval",
        f"paths.output_dir={tmp_path / 'eval'}",
        *(f"model.{args}.pretrained_model_name_or_path={out}" for args in ("model_args", "tokenizer_args")),
    ]
    env = {**os.environ, "TOFU_DIR": str(small_tofu_mirror)}
    result = subprocess.run(evaluation, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    summary = json.loads((tmp_path / "eval" / "TOFU_SUMMARY.json").read_text())
    for name in ("model_utility", "forget_Q_A_Prob", "forget_Q_A_ROUGE", "forget_truth_ratio"):
        assert isinstance(summary.get(name), float) and math.isfinite(summary[name]), (name, summary)
    assert 0 < summary["forget_Q_A_Prob"] < 1


# The other side-by-side methods with LoRA (issue 32: PALU, TPO, GradDiff, NPO, SimNPO at least): GradDiff
# with the KL retain loss reads a reference (the model with its adapters disabled), TPO reads one every
# step, SimNPO has none. palu-eval on a merged folder is the runs' above.
STOCK = "experiment=unlearn/tofu/default"
LORA_SIDE_BY_SIDE = {
    "GradDiff-KL-LoRA": [STOCK, "trainer=GradDiff", "trainer.method_args.retain_loss_type=KL", *LORA],
    "SimNPO-LoRA": [STOCK, "trainer=SimNPO", *LORA],
    "TPO-LoRA": [*METHOD_RUNS["TPO"], *LORA],
}


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("method", list(LORA_SIDE_BY_SIDE))
def test_every_side_by_side_method_trains_adapters_and_saves_them_merged(
    tmp_path, tiny_model_dir, small_tofu_mirror, shared_dir, method
):
    spans = tmp_path / "forget01.jsonl"
    import_tpo(shared_dir / "data" / "tofu_spans_gpt4o" / "forget01.jsonl", spans)
    spans.write_text("".join(spans.read_text().splitlines(keepends=True)[:EVAL_ROWS]))
    out = tmp_path / "run"
    history, output = palu_train(
        [
            *LORA_SIDE_BY_SIDE[method],
            *([f"span_annotations={spans}"] if method.startswith("TPO") else []),
            f"task_name={method}",
            "++trainer.args.max_steps=2",
        ],
        small_tofu_mirror,
        tiny_model_dir,
        out,
    )
    assert [entry["step"] for entry in history if "loss" in entry] == [1, 2]
    changed = changed_tensors(tiny_model_dir, out)
    assert len(changed) > 10 and all(name.endswith("proj.weight") for name in changed), changed
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    has_reference = not method.startswith("SimNPO")
    assert (
        "reference: the model with its LoRA adapters disabled (no second copy)" in output
    ) == has_reference


@pytest.mark.slow
@pytest.mark.stack
def test_palu_eval_in_bf16_on_this_stack(tmp_path, tiny_model_dir, small_tofu_mirror):
    """bf16 evaluation, the framework's GPU default: transformers >= 4.46 returns bf16 logits, which the
    framework's metrics hand to numpy ("Got unsupported ScalarType BFloat16" on the 4.51 stack, seen on an
    H200 before palu-train/palu-eval upcast evaluation logits)."""
    evaluation = [
        str(PALU_TRAIN.parent / "palu-eval"),
        "experiment=eval/tofu/tiny",
        "+runtime=cpu",
        "model.model_args.torch_dtype=bfloat16",
        "forget_split=forget01",
        "holdout_split=holdout01",
        "max_new_tokens=8",
        "task_name=bf16_eval",
        f"paths.output_dir={tmp_path / 'eval'}",
        *(
            f"model.{args}.pretrained_model_name_or_path={tiny_model_dir}"
            for args in ("model_args", "tokenizer_args")
        ),
    ]
    env = {**os.environ, "TOFU_DIR": str(small_tofu_mirror)}
    result = subprocess.run(evaluation, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    summary = json.loads((tmp_path / "eval" / "TOFU_SUMMARY.json").read_text())
    assert 0 < summary["forget_Q_A_Prob"] < 1 and math.isfinite(summary["forget_truth_ratio"]), summary
