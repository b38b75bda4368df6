"""The best model kept, end to end through palu-train and the framework's own src/train.py, offline: the
framework's TOFU evaluator at the start and after every epoch (its hub paths read from TOFU_DIR, a mirror
with 4-row evaluation sets), the rule of `+best_model=fq_at_mu_floor` picking the checkpoint that the final
model is, and the run stopping once MU stays under the floor (tests/training/test_best_model.py: the rules
on made-up sequences)."""

import json
import math
import subprocess

import pytest
from safetensors.torch import load_file

from palu_trainer.training.best_model import RECORD_FILE

from .test_bad_inputs import BIN, QUICK_RUN
from .test_framework_entry_point import environment, framework_command, program, train_through

NOT_EVALUATING = ("trainer.args.do_eval", "trainer.args.eval_on_start", "trainer.args.eval_strategy")
EPOCHS = 4
MU_SHARE = 0.75
STEPS_PER_EPOCH = 2  # forget01's 40 rows at batch 20
# the evaluator cut to the forget set's ROUGE (which stands in for FQ without retain logs) and a utility of
# one part, the retain set's answer probability: a tiny model's ROUGE on real authors is 0, and MU, a
# harmonic mean, with it
UNUSED_METRICS = (
    "forget_Q_A_Prob",
    "forget_truth_ratio",
    "forget_quality",
    "privleak",
    "extraction_strength",
)
UNUSED_UTILITY = ("retain_Q_A_ROUGE", "retain_Truth_Ratio") + tuple(
    f"{part}_{metric}"
    for part in ("ra", "wf")
    for metric in ("Q_A_Prob_normalised", "Q_A_ROUGE", "Truth_Ratio")
)


@pytest.fixture(scope="module")
def retain_memorising_model(tmp_path_factory, tiny_model_dir, small_tofu_mirror):
    """The tiny model finetuned until it answers the retain evaluation's 4 rows: a utility that unlearning
    at a high rate can only lower."""
    out = tmp_path_factory.mktemp("retain-memorising")
    models = (
        f"model.{args}.pretrained_model_name_or_path={tiny_model_dir}"
        for args in ("model_args", "tokenizer_args")
    )
    finetune = [
        "--config-name=train.yaml", "experiment=finetune/tofu/tiny", "+runtime=cpu",
        "train_split=retain_perturbed", "task_name=memorise", f"paths.output_dir={out}", *models,
    ]  # fmt: skip
    result = subprocess.run(
        [str(BIN / "palu-train"), *finetune], env={**environment(), "TOFU_DIR": str(small_tofu_mirror)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return out


@pytest.mark.slow(minutes=2)
@pytest.mark.parametrize("entry_point", ["palu-train", "src/train.py"])
def test_the_kept_model_is_the_rules_choice_and_a_run_under_the_floor_stops(
    entry_point, tmp_path, retain_memorising_model, tofu_mirror, small_tofu_mirror
):
    """mu_share 0.75 and patience 1: PALU at lr 2e-3 without its retain term (half the steps warming up)
    takes the memorised answers' probability down, epoch 1 above the floor and epoch 2 under it, where the
    run stops; the final weights are those of the checkpoint whose evaluation the rule ranks first (epoch
    1's, not the last), and palu_best_model.json says which and why."""
    run = [arg for arg in QUICK_RUN if not arg.startswith(NOT_EVALUATING)]
    out = tmp_path / "run"
    options = [
        "+best_model=fq_at_mu_floor",
        f"best_model.mu_share={MU_SHARE}",
        "best_model.patience=1",
        "trainer.args.per_device_train_batch_size=20",
        f"trainer.args.num_train_epochs={EPOCHS}",
        "trainer.args.learning_rate=2e-3",
        "trainer.args.warmup_ratio=0.5",
        "trainer.method_args.alpha=0",
        *(f"~eval.tofu.metrics.{metric}" for metric in UNUSED_METRICS),
        *(f"~eval.tofu.metrics.model_utility.pre_compute.{part}" for part in UNUSED_UTILITY),
    ]
    arguments = framework_command(tofu_mirror, retain_memorising_model, out, options, run=run)
    arguments = [arg for arg in arguments if arg not in ("~eval", "~eval.tofu")]
    result = train_through(entry_point, arguments, TOFU_DIR=str(small_tofu_mirror))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "evaluations are ranked by 1 - forget_Q_A_ROUGE instead" in output  # no retain logs: no FQ
    assert f"{program(entry_point)}:" not in output and "Traceback" not in output

    record = json.loads((out / RECORD_FILE).read_text())
    start, evaluations = record["starting_utility"], record["evaluations"]
    assert start > 0 and [each["step"] for each in evaluations] == [
        STEPS_PER_EPOCH * epoch for epoch in range(1, len(evaluations) + 1)
    ]
    floor = MU_SHARE * start
    under = [each["step"] for each in evaluations if each["utility"] < floor]
    assert under, evaluations  # the scenario: MU falls under the starting model's
    assert evaluations[-1]["step"] == under[0] < STEPS_PER_EPOCH * EPOCHS and record["stopped_early"]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == under[0]

    def rank(each):  # the rule: admissible first, by forgetting (ties: higher MU); else the nearest the floor
        admissible = each["utility"] >= floor
        return (admissible, each["forgetting"] if admissible else each["utility"], each["utility"])

    best = max(evaluations, key=rank)  # on a tie the earlier, as transformers keeps the first best
    assert record["kept"]["step"] == best["step"], record
    assert record["why"].startswith(f"epoch {best['epoch']:g} (step {best['step']}) ") or record[
        "why"
    ].startswith(
        f"no evaluation kept MU at {MU_SHARE:g} of the starting model's {start:.3g}: epoch {best['epoch']:g}"
    )
    final, kept = (
        load_file(out / "model.safetensors"),
        load_file(out / f"checkpoint-{best['step']}" / "model.safetensors"),
    )
    assert final.keys() == kept.keys()
    assert all(bool((final[name] == kept[name]).all()) for name in final)
    # the scenario: epoch 1 above the floor, epoch 2 under it, so the kept model is not the last one
    assert best["step"] == STEPS_PER_EPOCH < evaluations[-1]["step"], evaluations
    last = load_file(out / f"checkpoint-{evaluations[-1]['step']}" / "model.safetensors")
    assert any(not bool((final[name] == last[name]).all()) for name in final)
    assert math.isfinite(record["kept"]["forgetting"])
    # each evaluation's files stay in the checkpoint of its step, which the save wrote after them
    assert all(
        (out / f"checkpoint-{each['step']}" / "evals" / "TOFU_SUMMARY.json").is_file() for each in evaluations
    )
