"""Which model a run that evaluates during training keeps (`+best_model=fq_at_mu_floor` or `fq_mu_mean`,
configs/best_model/): after each evaluation the rule scores it (`ModelSelection.judge`, which the guarded
trainers' `evaluate` calls), transformers' own `load_best_model_at_end` keeps the checkpoint of the highest
score and loads it when training ends, so the final save is that model; evaluations under the utility floor
in a row stop the run (`patience`); `palu_best_model.json` in the output folder says which evaluation was
kept and why."""

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import TrainerCallback

from palu_trainer.training.run_guard import RunStopped
from palu_trainer.validation import Choice, Integer, Number, Options

logger = logging.getLogger(__name__)

SCORE = "palu_selection"  # `trainer.args.metric_for_best_model`: the score `judge` adds to the metrics
RECORD_FILE = "palu_best_model.json"
# (what measures forgetting, what measures utility), first found wins: TOFU's, then the fallbacks
FORGETTING = ("forget_quality", "forget_Q_A_ROUGE", "forget_knowmem_ROUGE")
UTILITY = ("model_utility", "retain_knowmem_ROUGE")
TIE_BREAK = 1e-9  # of utility added to a score: equal FQs (KS steps) go to the higher utility


class BestModelOptions(Options):
    """`best_model`: the rule that picks the kept evaluation."""

    OWNER = "best_model"

    rule: Choice(
        "fq_at_mu_floor: the highest FQ among the evaluations whose MU is at least mu_share of the starting "
        "model's; fq_mu_mean: the highest mean of FQ and MU (upstream issue #187)",
        "fq_at_mu_floor",
        "fq_mu_mean",
    ) = "fq_at_mu_floor"
    mu_share: Number("the utility floor, a share of the starting model's MU", ge=0, le=1) = 0.8
    patience: Integer(
        "evaluations in a row with MU under the floor that stop the run; null: never stop early",
        optional=True,
        ge=1,
    ) = None


@dataclass(frozen=True)
class Evaluation:
    step: int
    epoch: float
    forgetting: float  # FQ, or 1 - the forget set's ROUGE where FQ cannot be computed
    utility: float


def first_present(metrics: dict, names) -> tuple[str, float] | None:
    return next(((name, metrics[name]) for name in names if metrics.get(name) is not None), None)


class ModelSelection(TrainerCallback):
    """The rule of `options` applied to each evaluation of a trainer (`judge`), and its record."""

    def __init__(self, options: BestModelOptions):
        self.options = options
        self.fallback_told = False
        self.under_floor = 0

    def starting_utility(self, log_history: list[dict]) -> float | None:
        """The starting model's utility: the evaluation logged at step 0 (`eval_on_start`), which a resumed
        run's state carries too."""
        for entry in log_history:
            if entry.get("step") == 0 and (found := first_present(entry, UTILITY)):
                return float(found[1])
        return None

    def read(self, metrics: dict, step: int, epoch: float) -> Evaluation:
        utility = first_present(metrics, UTILITY)
        forgetting = first_present(metrics, FORGETTING)
        if utility is None or forgetting is None:
            raise RunStopped(
                f"best_model needs a utility ({' or '.join(UTILITY)}) and a forgetting measure "
                f"({' or '.join(FORGETTING)}) among the evaluation's metrics, which are "
                f"{', '.join(sorted(metrics)) or 'none'}: evaluate with the framework's TOFU or MUSE "
                "evaluator"
            )
        name, value = forgetting[0], float(forgetting[1])  # the metrics hold numpy numbers
        if name != FORGETTING[0]:
            value = 1 - value
            if not self.fallback_told:
                logger.warning(
                    "best_model: no forget_quality to read (it needs the retain model's evaluation, "
                    "retain_logs_path): evaluations are ranked by 1 - %s instead",
                    name,
                )
                self.fallback_told = True
        return Evaluation(step=step, epoch=epoch, forgetting=value, utility=float(utility[1]))

    def judge(self, metrics: dict, state, control) -> None:
        """Score the evaluation `metrics` of `state`'s step: `eval_palu_selection` added to them, and the run
        told to stop when its utility has stayed under the floor `patience` times in a row."""
        if state.global_step == 0:
            return  # the starting model: the floor's reference, not a candidate (it has no checkpoint)
        evaluation = self.read(metrics, state.global_step, state.epoch)
        start = self.starting_utility(state.log_history)
        needs_start = self.options.rule == "fq_at_mu_floor" or self.options.patience is not None
        if needs_start and start is None:
            raise RunStopped(
                f"best_model.rule={self.options.rule} measures MU against the starting model's: set "
                "trainer.args.eval_on_start=true (configs/best_model/ does)"
            )
        floor = self.options.mu_share * start if start is not None else -math.inf
        admissible = evaluation.utility >= floor
        if self.options.rule == "fq_mu_mean":
            score = (evaluation.forgetting + evaluation.utility) / 2
        elif admissible:
            score = evaluation.forgetting + TIE_BREAK * evaluation.utility
        else:  # below every admissible one, the nearer the floor the higher
            score = evaluation.utility / floor - 1 if floor > 0 else -1.0
        metrics[f"eval_{SCORE}"] = score
        self.under_floor = 0 if admissible else self.under_floor + 1
        if self.options.patience is not None and self.under_floor >= self.options.patience:
            logger.warning(
                "best_model: MU under %.3g (%g of the starting model's %.3g) at %d evaluations in a row: "
                "the run stops at step %d",
                floor, self.options.mu_share, start, self.under_floor, state.global_step,
            )  # fmt: skip
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            record = self.record(state)
            (Path(args.output_dir) / RECORD_FILE).write_text(json.dumps(record, indent=1))
            logger.info("best_model: %s", record["why"])

    def record(self, state) -> dict:
        """What was evaluated, which evaluation's model the output folder holds, and why."""
        start = self.starting_utility(state.log_history)
        evaluations = []
        for entry in state.log_history:
            if (
                entry.get("step", 0) > 0
                and first_present(entry, UTILITY)
                and first_present(entry, FORGETTING)
            ):
                evaluation = self.read(entry, entry["step"], entry.get("epoch"))
                floor = self.options.mu_share * start if start is not None else -math.inf
                evaluations.append(asdict(evaluation) | {"admissible": evaluation.utility >= floor})
        best = state.best_model_checkpoint
        kept_step = int(Path(best).name.split("-")[-1]) if best else None
        kept = next((each for each in evaluations if each["step"] == kept_step), None)
        if kept is None:
            why = "no evaluation after the start: the final model is the last step's"
        elif self.options.rule == "fq_mu_mean":
            why = (
                f"epoch {kept['epoch']:g} (step {kept['step']}) has the highest mean of forgetting "
                f"({kept['forgetting']:.3g}) and MU ({kept['utility']:.3g}) of {len(evaluations)} evaluations"
            )
        elif kept["admissible"]:
            why = (
                f"epoch {kept['epoch']:g} (step {kept['step']}) has the highest forgetting "
                f"({kept['forgetting']:.3g}) among the evaluations with MU at least "
                f"{self.options.mu_share:g} of the starting model's {start:.3g} "
                f"(its MU: {kept['utility']:.3g})"
            )
        else:
            why = (
                f"no evaluation kept MU at {self.options.mu_share:g} of the starting model's {start:.3g}: "
                f"epoch {kept['epoch']:g} (step {kept['step']}) came nearest (MU {kept['utility']:.3g})"
            )
        return {
            "rule": self.options.model_dump(),
            "starting_utility": start,
            "kept": kept,
            "checkpoint": best,
            "why": why,
            "stopped_early": self.options.patience is not None and self.under_floor >= self.options.patience,
            "evaluations": evaluations,
        }
