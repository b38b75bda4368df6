"""The converged real-model experiment (issue 30) end to end on a fake framework: each `train` writes a
checkpoint per epoch and its trainer_state, each `eval` an eval file whose numbers follow a designed
scenario; the real stages, caching, deletion, fronts, selection, seeds, cliff study and report run.

Scenario (per epoch e of E): FQ rises with the learning rate and e; MU falls with them, below 80% of the
Original's at the highest rate, and to 0 for PALU at 3e-5 (a cliff); PALU forgets most, and its scale-free
variant keeps MU at the cliff's rate.
"""

import hashlib
import json
import shutil
from concurrent.futures import Future
from pathlib import Path

import pytest

from palu_lab import converged, damage, miniature, real_model
from palu_lab.benchmarks.dataset_folders import TofuBenchmark
from palu_lab.converged import (
    CLIFF_VARIANTS,
    CONVERGED_KNOB_VALUES,
    CURVE_METRICS,
    Point,
    best_at_utility,
    cliff_runs,
    ks_statistic,
    pareto_front,
    tuning_runs,
)
from palu_lab.miniature import TOFU_SIZES
from palu_lab.real_model import Run, fq_ladder
from palu_trainer.experiments.report import EvaluatedModel

SIZE = TOFU_SIZES["smollm2-converged"]
FAST = TOFU_SIZES["smollm2-converged-fast"]
ORIGINAL_MU = 0.44


def test_the_broad_layout_is_issue_79s_protocol():
    """Original knows 2 forget and 18 retain authors; the forget set, holdout, MU's rows and budget are the
    four-author layout's; PALU, NPO and TPO on their own rates x two knob values, 20 runs, no PALU studies."""
    broad = TOFU_SIZES["smollm2-converged-broad"]
    assert list(broad.layout.retain_authors) == list(range(18)) and broad.layout.forget_rows == 40
    assert (broad.layout.forget_authors, broad.layout.holdout_authors) == (
        SIZE.layout.forget_authors,
        SIZE.layout.holdout_authors,
    )
    assert (broad.layout.eval_rows, broad.unlearn_epochs, broad.bf16) == (40, 10, False)
    runs = tuning_runs(converged.BROAD_ROWS, broad)
    assert len(runs) == 20
    assert sorted({run.learning_rate for run in runs if run.method == "PALU"}) == [1e-5, 2e-5, 3e-5, 1e-4]
    assert sorted({run.learning_rate for run in runs if run.method == "TPO"}) == [3e-5, 1e-4, 3e-4]
    assert not converged.runs_palu_studies(converged.BROAD_ROWS, broad, lora=False)
    assert converged.runs_palu_studies(converged.BROAD_ROWS, SIZE, lora=False)


def test_a_mid_epoch_checkpoint_stands_for_no_epoch(tmp_path):
    """A checkpoint written on SIGTERM at epoch 1.6 would round to 2 and could take epoch 2's place."""
    for step, epoch in ((5, 1.0), (8, 1.6), (10, 2.0), (12, 2.4)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"epoch": epoch}))
    assert miniature.whole_epoch_checkpoints(tmp_path) == {
        1: tmp_path / "checkpoint-5",
        2: tmp_path / "checkpoint-10",
    }


def test_the_plan_is_the_issues_protocol():
    """≥ 3 learning rates, the same for every method, crossed with two knob values; 10 epochs; the cliff
    study at the pilot's rate."""
    runs = tuning_runs(tuple(CONVERGED_KNOB_VALUES), SIZE)
    assert SIZE.unlearn_epochs == 10 and len(SIZE.unlearn_learning_rates) >= 3
    for method in CONVERGED_KNOB_VALUES:
        rates = sorted({run.learning_rate for run in runs if run.method == method})
        held = converged.HELD_BACK.get(method, ())
        all_held = {rate for rate, _ in held if (rate, 0) in held and (rate, 1) in held}
        grid = {*SIZE.unlearn_learning_rates, *converged.EXTENDED_RATES.get(method, ())}
        assert rates == sorted(grid - all_held)
        assert sum(run.method == method for run in runs) == 2 * len(rates) - len(held) + 2 * len(all_held)
    cgrad = {run.learning_rate for run in tuning_runs(["PALU_cgrad"], SIZE)}
    assert cgrad == {3e-6, *SIZE.unlearn_learning_rates} - {3e-4}  # both knob values held back at 3e-4
    names = {run.name for run in tuning_runs(["PALU_cgrad"], SIZE)}
    assert "PALU_lr3e-05_lambda1_c-gradient_seed0" in names
    assert "PALU_lr3e-05_lambda2_c-gradient_seed0" not in names
    fast = {run.learning_rate for run in tuning_runs(["PALU_cgrad"], FAST)}
    assert fast == set(FAST.unlearn_learning_rates)
    cliff = cliff_runs(SIZE)
    assert {run.learning_rate for run in cliff} == {3e-5} and len(cliff) == len(CLIFF_VARIANTS)
    assert all("trainer.method_args.kl_weight=1.0" in run.extra for run in cliff)
    assert any("trainer.method_args.local_loss_scale=reference" in run.extra for run in cliff)
    assert converged.evaluated_epochs(10) == (1, 2, 4, 6, 8)
    # one world-facts answer more or less moves MU by ~4% on 40 rows (~18% on 10: MU's steps, not methods)
    assert SIZE.layout.eval_rows == 40


def test_ks_statistic_is_read_off_the_ladder():
    ladder = fq_ladder(40)
    assert [ks_statistic(ladder[k], 40) for k in (0, 7, 9, 20, 40)] == [0, 7, 9, 20, 40]
    assert ks_statistic(None, 40) is None


def point(utility, quality, epoch=1):
    run = Run("X", "X", 0, 1e-5, {"lr": 1e-5})
    return Point(run, epoch, {"model_utility": utility, "forget_quality": quality})


def test_the_selection_is_the_best_admissible_epoch_with_ties_to_mu_then_the_lower_rate():
    original = {"model_utility": ORIGINAL_MU, "forget_quality": 1e-4}

    def at(rate, epoch, utility, quality):
        return Point(
            Run("X", "X", 0, rate, {"lr": rate}), epoch, {"model_utility": utility, "forget_quality": quality}
        )

    points = [
        at(1e-5, 10, 0.43, 2e-4),
        at(3e-5, 2, 0.36, 5e-3),  # the best FQ at MU >= 0.352 (80% of 0.44): an early epoch
        at(3e-5, 10, 0.0, 0.9),  # past the cliff: below the floor
        at(1e-4, 4, 0.36, 5e-3),  # ties: same FQ and MU, higher rate
        at(1e-4, 6, 0.35, 5e-3),  # same FQ, lower MU, and under the floor anyway
    ]
    chosen = converged.select_point(points, original)
    assert (chosen.run.learning_rate, chosen.epoch) == (3e-5, 2)
    points.append(at(1e-4, 2, 0.40, 5e-3))  # the same FQ at a higher MU wins over the lower rate
    assert (
        converged.select_point(points, original).run.learning_rate,
        converged.select_point(points, original).epoch,
    ) == (1e-4, 2)
    nothing_moves = [at(3e-6, epoch, 0.43, 1e-4) for epoch in (1, 2, 10)] + [at(1e-4, 10, 0.1, 0.5)]
    assert converged.select_point(nothing_moves, original) is None  # the Original's FQ at the floor


def test_pareto_front_and_best_at_utility():
    points = [point(0.44, 1e-4), point(0.40, 1e-2), point(0.41, 1e-3), point(0.30, 1e-2), point(0.1, 0.5)]
    front = pareto_front(points)
    assert [(p.utility, p.quality) for p in front] == [(0.44, 1e-4), (0.41, 1e-3), (0.40, 1e-2), (0.1, 0.5)]
    assert best_at_utility(points, 0.9 * ORIGINAL_MU).quality == 1e-2  # MU >= 0.396
    assert best_at_utility(points, 0.5) is None


def scenario(method: str, learning_rate: float, overrides: list[str], epoch: int, epochs: int) -> dict:
    """The fake eval's metrics for one run at one epoch."""
    share = epoch / epochs
    if converged.LORA_OVERRIDE in overrides:  # adapters: the same strengths at LoRA's rates, PALU milder
        learning_rate /= converged.LORA_RATE_FACTOR
        method = "PALU-LoRA" if method == "PALU" else method
    if "trainer.method_args.target_gradient=true" in overrides:  # issue 59's form: no cliff
        method = "PALU-c-gradient"
    strength = {3e-6: 0.03, 1e-5: 0.1, 2e-5: 0.3, 3e-5: 0.5, 1e-4: 1.0, 3e-4: 2.0}[round(learning_rate, 12)]
    base = {"GradDiff": 0.2, "NPO": 0.4, "SimNPO": 0.3, "TPO": 0.35, "PALU": 0.6, "PALU-LoRA": 0.3,
            "PALU-c-gradient": 0.5, "PALU_release": 0.45}[method]  # fmt: skip
    quality = min(1.0, 1e-4 * 10 ** (4 * base * strength * share))
    utility = ORIGINAL_MU * (1 - 0.15 * strength * share)
    if learning_rate == 3e-5 and method == "PALU":  # the cliff
        utility = ORIGINAL_MU * max(0.0, 1 - 1.2 * share)
        if "trainer.method_args.local_loss_scale=reference" in overrides:
            utility = ORIGINAL_MU * (1 - 0.1 * share)
    if "trainer.method_args.target=uniform" in overrides:  # "too strict": forgets more, keeps less
        quality, utility = min(1.0, quality * 100), utility * 0.5
    if "trainer.method_args.target=ref_mean" in overrides:
        quality /= 2
    if any(part.startswith("trainer.args.seed=") and not part.endswith("=0") for part in overrides):
        quality *= 1.1
    return {
        "forget_quality": {"agg_value": quality},
        "model_utility": {"agg_value": utility},
        "forget_Q_A_ROUGE": {"agg_value": 1 - share * strength},
    }


class FakeFramework:
    """Stands in for open-unlearning's train.py and eval.py (miniature.run_framework)."""

    def __init__(self, epochs: int):
        self.epochs, self.trained, self.evaluated = epochs, [], []

    def __call__(self, entry, overrides, log_path, env):
        value = {part.split("=", 1)[0]: part.split("=", 1)[1] for part in overrides if "=" in part}
        out_dir = Path(value["paths.output_dir"])
        out_dir.mkdir(parents=True, exist_ok=True)
        if entry == "train":
            self.trained.append(overrides)
            assert "trainer.args.save_strategy=epoch" in overrides
            steps = 5
            for epoch in range(1, self.epochs + 1):
                checkpoint = out_dir / f"checkpoint-{steps * epoch}"
                checkpoint.mkdir()
                (checkpoint / "trainer_state.json").write_text(json.dumps({"epoch": float(epoch)}))
                (checkpoint / "run.json").write_text(json.dumps(overrides))
            (out_dir / "model.safetensors").write_bytes(b"weights")
            (out_dir / "run.json").write_text(json.dumps(overrides))
            palu = any(part == "trainer=PALU" for part in overrides)
            log = [
                {"step": 1, "loss": 41.4, "local_loss": 41.4, "kl_loss": 0.0, "retain_loss": 0.007,
                 "grad_norm": 780.0, "grad_norm_local": 779.0, "grad_norm_kl": 0.0, "grad_norm_retain": 3.0},
                {"step": 5, "loss": 2.0, "local_loss": 1.0, "kl_loss": 0.5, "retain_loss": 0.5,
                 "grad_norm": 9.0},
            ]  # fmt: skip
            (out_dir / "trainer_state.json").write_text(json.dumps({"log_history": log if palu else []}))
            return 3.0
        model = Path(value["model.model_args.pretrained_model_name_or_path"])
        assert model.is_dir(), f"evaluating a deleted model {model}"
        self.evaluated.append(overrides)
        run_overrides = json.loads((model / "run.json").read_text())
        run_value = {p.split("=", 1)[0]: p.split("=", 1)[1] for p in run_overrides if "=" in p}
        method = run_value["trainer"]
        epoch = round(json.loads((model / "trainer_state.json").read_text()).get("epoch", self.epochs))
        if model.name.startswith("checkpoint"):
            assert all(metric in overrides for metric in CURVE_METRICS)
        else:
            assert not any(metric in overrides for metric in CURVE_METRICS)
        rate = float(run_value["trainer.args.learning_rate"])
        logs = scenario(method, rate, run_overrides, epoch, self.epochs)
        (out_dir / "TOFU_EVAL.json").write_text(json.dumps(logs))
        return 1.0


class FakeMiniature:
    def __init__(self, stages, original_dir, original_eval, retain_eval):
        self.stages, self.original_dir = stages, original_dir
        self.original_eval, self.retain_eval = original_eval, retain_eval
        self.notes = ["Data: fake."]

    def references(self):
        return {
            "Original": EvaluatedModel({"forget_quality": 1e-4, "model_utility": ORIGINAL_MU}),
            "Retain": EvaluatedModel({"forget_quality": 1.0, "model_utility": 0.45}),
        }


@pytest.fixture
def fake_experiment(tmp_path, monkeypatch):
    data = tmp_path / "data"
    spans = data / "span_annotations" / "forget05.jsonl"
    spans.parent.mkdir(parents=True)
    spans.write_text("{}\n")
    (data / "full.json").write_text("{}\n")
    benchmark = TofuBenchmark(data, "forget05", "retain_subset", "holdout05", spans, 32, "")
    original = tmp_path / "original"
    original.mkdir()
    (original / "model.safetensors").write_bytes(b"original")
    references = {}
    for name in ("original", "retain"):  # finished evaluation stages
        stage = tmp_path / f"eval-{name}"
        stage.mkdir()
        (stage / "demo_stage.json").write_text(json.dumps({"wall_time_s": 1.0}))
        logs = {"forget_truth_ratio": {"agg_value": 0.6, "value_by_index": {"0": {"score": 0.6}}}}
        (stage / "TOFU_EVAL.json").write_text(json.dumps(logs))
        references[name] = Future()
        references[name].set_result(stage / "TOFU_EVAL.json")
    framework = FakeFramework(SIZE.unlearn_epochs)
    monkeypatch.setattr(miniature, "run_framework", framework)

    def fake_miniature(args, progress, pool):
        stages = miniature.Stages(benchmark, SIZE, args.run_dir, args.results / ".cache", progress)
        return FakeMiniature(stages, original, references["original"], references["retain"])

    monkeypatch.setattr(converged, "tofu_miniature", fake_miniature)
    arguments = ["--data", "tofu", "--tofu-dir", str(tmp_path), "--results", str(tmp_path), "--jobs", "2"]
    return framework, arguments, tmp_path / "converged-smollm2-tofu"


def test_the_experiment_end_to_end_on_a_fake_framework(fake_experiment):
    framework, arguments, out = fake_experiment
    converged.main(arguments)
    rows = len(converged.CONVERGED_ROWS)  # the five methods, PALU with c's gradient, PALU_release
    extended = 2 * sum(len(rates) for rates in converged.EXTENDED_RATES.values())  # 3e-6, c-gradient rows
    held = sum(len(runs) for runs in converged.HELD_BACK.values())
    tuning = rows * 2 * len(SIZE.unlearn_learning_rates) + extended - held
    seeds, cliff = rows * 2, len(CLIFF_VARIANTS)
    targets = 3  # uniform, topk_mean, ref_mean; global_mean is PALU's selected run
    assert len(framework.trained) == tuning + seeds + cliff + targets
    assert len(framework.evaluated) == (tuning + seeds + cliff + targets) * 6  # epochs 1-8, then 10
    assert not list((out.parent / ".cache").glob("unlearn-*/checkpoint-*"))  # deleted once evaluated
    assert not list((out.parent / ".cache").glob("unlearn-*/model.safetensors"))
    summary = json.loads((out / "converged.json").read_text())
    # at MU >= 80% the most forgetting is 3e-4 at epoch 6 (later epochs fall below the floor), and where 3e-4
    # is held back (the c-gradient rows) 1e-4 at epoch 10; the knob values tie, the first kept
    assert summary["selected"]["NPO"] == "NPO_lr0.0003_beta0.1_seed0"
    assert summary["selected"]["PALU"] == "PALU_lr0.0003_lambda1_seed0"
    assert summary["selected_epochs"]["PALU"] == summary["selected_epochs"]["NPO"] == 6
    assert summary["selected"]["PALU_cgrad"] == "PALU_lr0.0001_lambda1_c-gradient_seed0"
    assert summary["selected"]["PALU_release"] == "PALU_release_lr0.0001_alpha1_seed0"
    assert summary["selected_epochs"]["PALU_release"] == 10
    # the new rows' runs in the pool's order: the first knob value at 3e-6 (the extension), 1e-5, 3e-5, 1e-4,
    # then the second at 3e-6 and 1e-5 (the rest held back)
    new = [
        next(part for part in overrides if part.startswith("trainer.args.learning_rate="))
        for overrides in framework.trained
        if "trainer=PALU_release" in overrides or any("target_gradient" in part for part in overrides)
    ]
    knob_value = [
        f"trainer.args.learning_rate={rate}" for rate in ("3e-06", "1e-05", "3e-05", "0.0001") for _ in "ab"
    ]
    assert new[:12] == knob_value + knob_value[:4]
    palu = summary["rows"]["PALU"]["forget_quality"]
    assert palu["seeds"] == 3 and palu["high"] == pytest.approx(palu["low"] * 1.1)
    assert summary["reading"][0].startswith("PALU beats")
    assert summary["fronts"][0].startswith("At MU ≥ 90% of the Original's (≥ 0.396), best FQ: PALU")
    curve = summary["curves"]["PALU"]
    assert list(curve) == ["0", "1", "2", "4", "6", "8", "10"]
    assert curve["0"]["forget_quality"]["mean"] == 1e-4 and curve["10"]["forget_quality"]["seeds"] == 3
    at_90, at_80 = summary["cliff"]
    assert at_90.startswith(
        "At MU ≥ 90% of the Original's, the paper's form has no point; higher: scale-free"
    )
    assert at_80.startswith("At MU ≥ 80% of the Original's, the paper's form reaches FQ")
    markdown = (out / "converged.md").read_text()
    held_note = "Held back after issue 59's 12 tuning hours (they cannot change the selection): PALU_cgrad lr"
    assert f"{held_note} 3e-05 lambda 2;" in markdown
    assert "| paper (λ=1, lr 3e-05) | 41.4 / 0 / 0.007 | 779 / 0 / 3 (780) |" in markdown
    # every cliff row has the header's cells: a label's own "|" (K=1% of |V|) would shift the row's cells
    cliff_lines = markdown.split("## PALU's utility cliff")[1].split("\n\n")[1].splitlines()
    cells = [len(line.replace("\\|", "").split("|")) for line in cliff_lines]
    assert len(cliff_lines) == 2 + 1 + len(CLIFF_VARIANTS) and set(cells) == {cells[0]}
    # the target ablation at PALU's selected setting: its runs carry that setting and one target each
    ablated = [o for o in framework.trained if any(p.startswith("trainer.method_args.target=") for p in o)]
    selected_rate = "trainer.args.learning_rate=1e-05"  # PALU's selection when the ablation ran
    targets_run = {
        p for o in ablated if selected_rate in o for p in o if p.startswith("trainer.method_args.t")
    }
    assert targets_run == {f"trainer.method_args.target={c}" for c in ("uniform", "topk_mean", "ref_mean")}
    ranking, paper = summary["targets"]
    assert ranking.startswith("Ranked by the best FQ at MU ≥ 80% of the Original's along the curve: ")
    assert ranking.index("global_mean") < ranking.index("ref_mean") and "uniform (no point)" in ranking
    assert paper == converged.PAPER_TARGET_READING
    target_lines = markdown.split("## The paper's target ablation")[1].split("\n\n")[2].splitlines()
    assert [line.split(" | ")[0] for line in target_lines[2:]] == [
        "| uniform", "| topk_mean", "| ref_mean", "| global_mean (default)"
    ]  # fmt: skip
    assert summary["commit"] and summary["stage_times_s"]
    for plot in ("curves.png", "fronts.png", "targets.png"):
        assert (out / plot).stat().st_size > 10_000
    # a second run finds every stage cached: nothing trains or evaluates again, the report is the same
    trained, evaluated = len(framework.trained), len(framework.evaluated)
    converged.main(arguments)
    assert (len(framework.trained), len(framework.evaluated)) == (trained, evaluated)
    again = json.loads((out / "converged.json").read_text())
    assert again["rows"] == summary["rows"] and again["fronts"] == summary["fronts"]
    # its machine time is the stages' own, made in the first run: a run continued across restarts states it
    made = [seconds for name, seconds in again["made_times_s"].items() if name.startswith("unlearn ")]
    assert len(made) == len(framework.trained) and min(made) > 0
    assert not any(
        again["stage_times_s"][name] for name in again["made_times_s"] if name.startswith("unlearn ")
    )
    assert again["machine_time_h"] == pytest.approx(summary["machine_time_h"])
    assert "Fluency is — in every row" in markdown


def test_the_broad_layout_runs_its_grid_and_a_method_without_an_admissible_point_gets_none(
    fake_experiment, monkeypatch
):
    """`--layout broad`: the 20 tuning runs in their own folder, no PALU studies. With an Original that no
    point beats on FQ, no row has an admissible point: none is selected, no seed runs, and the report says
    so instead of naming a setting."""
    framework, arguments, out = fake_experiment
    unbeatable = {"forget_quality": 1.0, "model_utility": ORIGINAL_MU}
    monkeypatch.setattr(
        FakeMiniature,
        "references",
        lambda self: {"Original": EvaluatedModel(unbeatable), "Retain": EvaluatedModel(unbeatable)},
    )
    converged.main([*arguments, "--layout", "broad"])
    assert len(framework.trained) == 20
    broad = out.with_name("converged-broad-smollm2-tofu")
    summary = json.loads((broad / "converged.json").read_text())
    assert summary["selected"] == {"PALU": None, "NPO": None, "TPO": None}
    assert summary["reading"] == ["PALU has no admissible point: no reading."]
    markdown = (broad / "converged.md").read_text()
    assert "| PALU: no admissible point | — |" in markdown
    assert (
        "Selected: PALU: no admissible point; NPO: no admissible point; TPO: no admissible point." in markdown
    )
    assert "## PALU's utility cliff" not in markdown and not out.exists()


def test_an_archived_experiment_continues_on_a_machine_without_its_cache(fake_experiment, tmp_path):
    """`--archive`: every finished run's stages go to a folder small enough to commit (no weights, no
    checkpoints; evaluations reduced to their aggregates, Retain's whole: later forget qualities read its
    rows). With the cache gone, as on a new machine, the run restores them: nothing trains or evaluates
    again, the report is the same, and it names the Original the runs started from."""
    framework, arguments, out = fake_experiment
    archive = tmp_path / "archive"
    converged.main([*arguments, "--archive", str(archive)])
    summary = json.loads((out / "converged.json").read_text())
    runs = len(framework.trained)
    assert len(list(archive.glob("unlearn-*/trainer_state.json"))) == runs
    assert len(list(archive.glob("eval-*/TOFU_EVAL.json"))) == runs * 6 + 2
    archived = [path.name for path in archive.rglob("*")]
    assert not [name for name in archived if name.endswith(".safetensors") or name.startswith("checkpoint")]
    assert (
        "value_by_index"
        in json.loads((archive / "eval-retain" / "TOFU_EVAL.json").read_text())["forget_truth_ratio"]
    )
    unlearned = next(path for path in archive.glob("eval-*/TOFU_EVAL.json") if "eval-r" not in str(path))
    assert all(list(value) == ["agg_value"] for value in json.loads(unlearned.read_text()).values())
    origin = json.loads(next(archive.glob("unlearn-*/origin.json")).read_text())
    assert origin["original"] == hashlib.sha1(b"model.safetensors" + b"original").hexdigest()[:16]

    shutil.rmtree(out.parent / ".cache")
    trained, evaluated = len(framework.trained), len(framework.evaluated)
    converged.main([*arguments, "--archive", str(archive)])
    assert (len(framework.trained), len(framework.evaluated)) == (trained, evaluated)
    again = json.loads((out / "converged.json").read_text())
    assert again["rows"] == summary["rows"] and again["fronts"] == summary["fronts"]
    markdown = (out / "converged.md").read_text()
    assert f"{origin['original']} ({runs} runs)" in markdown
    assert f"by the commit that ran them: {origin['commit']} ({runs} runs)" in markdown


def test_the_lora_rows_end_to_end_on_a_fake_framework(fake_experiment):
    """`--lora`: PALU and NPO with +peft=lora, the same tuning budget (4 rates x 2 knob values, 2 more seeds)
    at LoRA's rates, no cliff study, reported in lora/ with rows named as LoRA rows."""
    framework, arguments, out = fake_experiment
    converged.main([*arguments, "--lora"])
    assert len(framework.trained) == 2 * 2 * len(SIZE.unlearn_learning_rates) + 2 * 2
    assert all(converged.LORA_OVERRIDE in overrides for overrides in framework.trained)
    rates = {part for overrides in framework.trained for part in overrides if "learning_rate=" in part}
    assert rates == {f"trainer.args.learning_rate={rate}" for rate in (0.0001, 0.0003, 0.001, 0.003)}
    summary = json.loads((out / "lora" / "converged.json").read_text())
    assert summary["selected"] == {
        "PALU LoRA": "PALU_LoRA_lr0.003_lambda1_seed0",
        "NPO LoRA": "NPO_LoRA_lr0.003_beta0.1_seed0",
    }
    assert summary["rows"]["PALU LoRA"]["forget_quality"]["seeds"] == 3
    assert summary["reading"][0].startswith("PALU LoRA beats none of NPO LoRA")
    assert summary["cliff"] == [] and "subject" not in summary
    markdown = (out / "lora" / "converged.md").read_text()
    assert markdown.startswith("# Converged: PALU and NPO with LoRA adapters")
    assert "the full-finetuning grid x 10" in markdown and "| PALU LoRA |" in markdown
    assert not (out / "converged.json").exists()  # the full-finetuning report is not touched
    assert "No full-finetuning report at" in markdown and summary["against_full_finetuning"] == []


def test_the_lora_report_sets_each_lora_row_beside_its_full_finetuning_row(fake_experiment):
    """With the full-finetuning report made first, the LoRA report reads it: per method, both rows over
    seeds, the best FQ each reaches on seed 0 at each utility floor (the full report's own fronts), and a
    reading of LoRA against full finetuning; the curves plot draws the full curves beside the LoRA ones."""
    framework, arguments, out = fake_experiment
    converged.main(arguments)
    full = json.loads((out / "converged.json").read_text())
    trained = len(framework.trained)
    converged.main([*arguments, "--lora"])
    assert len(framework.trained) == trained + 2 * 2 * len(SIZE.unlearn_learning_rates) + 2 * 2
    lora = json.loads((out / "lora" / "converged.json").read_text())
    markdown = (out / "lora" / "converged.md").read_text()
    section = markdown.split("## LoRA against full finetuning")[1]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    names = [line.split(" | ")[0].removeprefix("| ") for line in rows]
    assert names[1:5] == ["PALU (full finetuning)", "PALU LoRA", "NPO (full finetuning)", "NPO LoRA"]
    palu_fq = real_model.Spread(**full["rows"]["PALU"]["forget_quality"]).format()
    assert rows[1].startswith(f"| PALU (full finetuning) | {palu_fq} |")
    # the best FQ at MU >= 90% (>= 0.396) on seed 0, by the scenario: full PALU at 1e-4 and LoRA PALU at
    # 1e-3 (its strength 1 too, milder), both at epoch 6 (MU 0.400): 1e-4 x 10^(4 x base x 0.6)
    front_row = next(line for line in rows if line.startswith("| PALU | ")).split(" | ")
    assert front_row[1:3] == [
        f"{1e-4 * 10 ** (4 * 0.6 * 0.6):.3g} (PALU_lr0.0001_lambda1_seed0, ep 6, MU 0.400)",
        f"{1e-4 * 10 ** (4 * 0.3 * 0.6):.3g} (PALU_LoRA_lr0.001_lambda1_seed0, ep 6, MU 0.400)",
    ]
    assert front_row[1].split(" (")[0] in full["fronts"][0]  # the full report's own front agrees
    reading = lora["against_full_finetuning"]
    assert [line.split(":")[0] for line in reading] == [
        "PALU LoRA vs PALU (full finetuning)",
        "NPO LoRA vs NPO (full finetuning)",
    ]
    assert (out / "lora" / "curves.png").stat().st_size > 10_000


def test_the_fast_variant_plans_two_epochs(capsys):
    converged.main(["--data", "tofu", "--tofu-dir", "/nonexistent", "--fast", "--plan"])
    printed = capsys.readouterr().out
    assert FAST.unlearn_epochs == 2 and "evaluated after epochs [1]" in printed
    assert "2 forget rows" in printed


def test_the_curve_metrics_delete_metrics_the_framework_evaluates():
    """Each `~eval.tofu.metrics.X` names a metric of the stock TOFU evaluation by its config's @package key
    (forget_Truth_Ratio.yaml is `forget_truth_ratio`): Hydra refuses to delete a key that is not there."""
    import yaml

    from palu_trainer.framework.checkout import checkout_dir

    configs = checkout_dir() / "configs" / "eval"
    listed = yaml.safe_load((configs / "tofu.yaml").read_text())["defaults"][0]["tofu_metrics"]
    keys = set()
    for name in listed:
        first = (configs / "tofu_metrics" / f"{name}.yaml").read_text().splitlines()[0]
        keys.add(first.removeprefix("# @package eval.tofu.metrics."))
    deleted = {override.removeprefix("~eval.tofu.metrics.") for override in CURVE_METRICS}
    assert deleted <= keys and {"forget_quality", "forget_Q_A_ROUGE", "model_utility"} <= keys - deleted


def test_the_damage_command_makes_a_run_again_and_keeps_its_evaluated_epochs(
    fake_experiment, tmp_path, monkeypatch
):
    """damage.py's `--converged-runs`: the archived runs keep no weights, so the named run trains again, in
    a stage of its own, and every evaluated epoch's checkpoint is there to measure."""
    framework, arguments, _ = fake_experiment
    monkeypatch.setattr(miniature, "tofu_miniature", converged.tofu_miniature)  # the fake
    name = "NPO_lr0.0001_beta0.1_seed0"
    reference, data_dir, checkpoints = damage.converged_checkpoints([name], tmp_path, tmp_path, 1)
    assert reference == tmp_path / "original" and data_dir == tmp_path / "data"  # the fake benchmark's
    assert list(checkpoints) == [f"{name} epoch {epoch}" for epoch in (1, 2, 4, 6, 8, 10)]
    assert len(framework.trained) == 1
    trained = framework.trained[0]
    assert "trainer=NPO" in trained and "trainer.args.learning_rate=0.0001" in trained
    for label, path in checkpoints.items():
        epoch = int(label.rsplit(" ", 1)[1])
        state = json.loads((path / "trainer_state.json").read_text())
        assert state.get("epoch", 10) == epoch and tmp_path / ".cache" in path.parents
        assert (path / "model.safetensors").exists() or path.name.startswith("checkpoint-")
    # the converged experiment's own stage of that run is another one: it trains it and deletes its weights
    converged.main(arguments)

    def command(overrides):  # without the stage's own folder
        return [part for part in overrides if not part.startswith(("paths.output_dir=", "task_name="))]

    assert sum(command(overrides) == command(trained) for overrides in framework.trained) == 2
    assert all(path.exists() for path in checkpoints.values())


def test_the_finetune_recipe_keeps_the_bytes_that_key_the_archived_original():
    """Original's stage key holds the bytes of its experiment YAML, and every archived run is keyed by
    Original's folder: an edit to that file, even to a comment, re-runs the whole archive (e4633db did;
    caught before a run was lost). Change the file only with a plan to re-run the converged experiment."""
    recipe = miniature.CONFIG_DIR / "experiment" / "finetune" / "tofu" / "tiny.yaml"
    assert miniature.file_digest(recipe) == "f92586b39852895a18b6ad237b68f46533165692"
