"""The best-model rules on sequences of evaluations: the score each evaluation gets, which one a run keeps,
when it stops early, and the record that says so (tests/framework/test_best_model.py runs them end to end)."""

import json
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState

from palu_trainer.training.best_model import RECORD_FILE, SCORE, BestModelOptions, ModelSelection
from palu_trainer.training.run_guard import RunStopped

START = {"step": 0, "epoch": 0, "forget_quality": 1e-4, "model_utility": 0.40}


def run_through(options: dict, evaluations: list[dict], start=START):
    """Judge `evaluations` (metrics, one per epoch, 2 steps each) as a trainer would, keeping the highest
    score as transformers' load_best_model_at_end does (strictly greater); returns the selection, the
    state, the scores and the step training stopped at (None: never)."""
    selection = ModelSelection(BestModelOptions.parse(options))
    state, control = TrainerState(), TrainerControl()
    state.log_history = [dict(start)] if start else []
    scores, stopped = [], None
    for epoch, metrics in enumerate(evaluations, start=1):
        state.global_step, state.epoch = 2 * epoch, float(epoch)
        state.log_history.append({**metrics, "step": state.global_step, "epoch": state.epoch})
        metrics = dict(metrics)
        selection.judge(metrics, state, control)
        scores.append(metrics[f"eval_{SCORE}"])
        if state.best_metric is None or scores[-1] > state.best_metric:
            state.best_metric = scores[-1]
            state.best_model_checkpoint = f"/runs/run/checkpoint-{state.global_step}"
        if control.should_training_stop:
            stopped = state.global_step
            break
    return selection, state, scores, stopped


def evaluation(fq, mu):
    return {"forget_quality": fq, "model_utility": mu}


def test_fq_at_the_floor_keeps_the_highest_admissible_fq_and_ties_go_to_the_higher_mu():
    # floor 0.8 x 0.40 = 0.32: epoch 3's FQ is the highest but under it; epochs 2 and 4 tie on FQ
    sequence = [evaluation(0.01, 0.39), evaluation(0.2, 0.33), evaluation(0.9, 0.10), evaluation(0.2, 0.36)]
    selection, state, scores, stopped = run_through({"rule": "fq_at_mu_floor"}, sequence)
    assert stopped is None
    assert scores[2] < 0 < scores[0] < scores[1] < scores[3]  # under the floor: below every admissible one
    assert state.best_model_checkpoint.endswith("checkpoint-8")
    record = selection.record(state)
    assert record["kept"] == {"step": 8, "epoch": 4.0, "forgetting": 0.2, "utility": 0.36, "admissible": True}
    assert record["why"] == (
        "epoch 4 (step 8) has the highest forgetting (0.2) among the evaluations with MU at least 0.8 of the "
        "starting model's 0.4 (its MU: 0.36)"
    )
    assert [each["admissible"] for each in record["evaluations"]] == [True, True, False, True]


def test_with_no_admissible_evaluation_the_nearest_to_the_floor_is_kept_and_said_so():
    sequence = [evaluation(0.5, 0.10), evaluation(0.9, 0.30), evaluation(0.9, 0.05)]
    selection, state, scores, _ = run_through({"rule": "fq_at_mu_floor"}, sequence)
    assert state.best_model_checkpoint.endswith("checkpoint-4")
    assert selection.record(state)["why"].startswith(
        "no evaluation kept MU at 0.8 of the starting model's 0.4: epoch 2 (step 4) came nearest (MU 0.3)"
    )


def test_the_mean_rule_of_issue_187_needs_no_starting_model():
    sequence = [evaluation(0.1, 0.4), evaluation(0.6, 0.2), evaluation(0.3, 0.3)]
    selection, state, scores, _ = run_through({"rule": "fq_mu_mean"}, sequence, start=None)
    assert scores == pytest.approx([0.25, 0.4, 0.3])
    assert state.best_model_checkpoint.endswith("checkpoint-4")
    assert "highest mean of forgetting (0.6) and MU (0.2) of 3 evaluations" in selection.record(state)["why"]


def test_patience_stops_the_run_after_that_many_evaluations_in_a_row_under_the_floor():
    sequence = [evaluation(0.1, 0.30), evaluation(0.1, 0.35), evaluation(0.2, 0.31), evaluation(0.3, 0.2)]
    selection, state, _, stopped = run_through({"patience": 2}, sequence)
    assert (
        stopped == 8
    )  # epoch 1 under the floor, epoch 2 above it (the count restarts), epochs 3 and 4 under
    assert selection.record(state)["stopped_early"] is True
    _, _, _, never = run_through({"patience": 3}, sequence)
    assert never is None


def test_without_fq_the_forget_rouge_stands_in_and_the_log_says_so_once(caplog):
    sequence = [
        {"forget_quality": None, "forget_Q_A_ROUGE": rouge, "model_utility": 0.4} for rouge in (0.9, 0.5)
    ]
    with caplog.at_level("WARNING"):
        _, state, scores, _ = run_through({}, sequence)
    assert scores == pytest.approx([0.1, 0.5], abs=1e-6) and state.best_model_checkpoint.endswith("-4")
    told = [r.message for r in caplog.records if "no forget_quality" in r.message]
    assert told == [
        "best_model: no forget_quality to read (it needs the retain model's evaluation, retain_logs_path): "
        "evaluations are ranked by 1 - forget_Q_A_ROUGE instead"
    ]


def test_a_floor_without_the_starting_evaluation_or_metrics_without_utility_stop_in_one_line():
    with pytest.raises(RunStopped, match=r"best_model.rule=fq_at_mu_floor measures MU against the starting "):
        run_through({}, [evaluation(0.1, 0.4)], start=None)
    with pytest.raises(
        RunStopped, match=r"best_model needs a utility \(model_utility or retain_knowmem_ROUGE"
    ):
        run_through({}, [{"forget_quality": 0.1}])


def test_bad_options_are_named():
    with pytest.raises(ValueError, match=r"best_model.mu_share=1.5: must be a number >= 0 and <= 1"):
        BestModelOptions.parse({"mu_share": 1.5}, "best_model.")
    with pytest.raises(ValueError, match=r"best_model.patiense is not an option of best_model: did you mean"):
        BestModelOptions.parse({"patiense": 2}, "best_model.")


def test_the_record_is_written_at_the_end_of_training(tmp_path):
    selection, state, _, _ = run_through({}, [evaluation(0.1, 0.4), evaluation(0.3, 0.39)])
    state.is_world_process_zero = True
    selection.on_train_end(SimpleNamespace(output_dir=str(tmp_path)), state, TrainerControl())
    record = json.loads((tmp_path / RECORD_FILE).read_text())
    assert record["kept"]["step"] == 4 and record["rule"] == {"rule": "fq_at_mu_floor", "mu_share": 0.8,
                                                               "patience": None}  # fmt: skip
    assert record["checkpoint"] == "/runs/run/checkpoint-4" and len(record["evaluations"]) == 2
