"""What a run's checkpoints record of how they were made, and what resuming checks against it: the model it
started from (path and weights fingerprint), the trainer, its method options and LoRA settings
(`run_options`, `RUN_OPTIONS_FILE`), and its forget and retain data (`run_data`, `RUN_DATA_FILE`); a resume
under others stops naming both, unless asked (`ALLOW_OTHER_OPTIONS`, `ALLOW_OTHER_DATA`)."""

import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf
from transformers import TrainerCallback

# Top-level keys (`+key=true`) that let a resume through on purpose.
ALLOW_OTHER_DATA = "allow_resume_on_other_data"
RUN_DATA_FILE = "palu_run_data.json"
ALLOW_OTHER_OPTIONS = "allow_resume_under_other_options"
RUN_OPTIONS_FILE = "palu_run_options.json"

STARTING_MODEL = ("model", "model weights")  # run_options' keys of the model unlearning started from


def run_options(cfg) -> dict:
    """What a run's checkpoints are trained under, besides its data, as `key: value`: the model it started
    from (its path and `resume.weights_fingerprint`: the reference, whose targets PALU and the stock methods'
    reference terms read), the trainer, its `method_args` and the LoRA settings."""
    from palu_trainer.training.resume import weights_fingerprint

    model = OmegaConf.select(cfg, "model.model_args.pretrained_model_name_or_path")
    options = {STARTING_MODEL[0]: model, STARTING_MODEL[1]: weights_fingerprint(model) if model else None}
    options["trainer"] = cfg.trainer.get("handler")
    for prefix, node in (("trainer.method_args", cfg.trainer.get("method_args")), ("peft", cfg.get("peft"))):
        values = OmegaConf.to_container(node, resolve=True) if node is not None else {}
        options.update({f"{prefix}.{key}": value for key, value in values.items()})
    return options


def resume_options_problem(cfg, script) -> str | None:
    """A resume under other method options than its checkpoint was trained with: the differences listed."""
    from palu_trainer.training.resume import checkpoint_to_resume

    try:
        checkpoint = checkpoint_to_resume(
            cfg.trainer.args.get("resume_from_checkpoint"), cfg.paths.output_dir
        )
    except (FileNotFoundError, ValueError):
        return None  # reported by the trainer's own resume (palu-train: before loading)
    if checkpoint is None or cfg.get(ALLOW_OTHER_OPTIONS, False):
        return None
    path = Path(checkpoint) / RUN_OPTIONS_FILE
    if not path.is_file():
        return None  # a checkpoint of a run without the plugin's callback: nothing to compare
    then, now = json.loads(path.read_text()), run_options(cfg)
    weights = STARTING_MODEL[1]
    if then.get(weights) is not None and then[weights] != now[weights]:
        started, asked = (
            f"{o[STARTING_MODEL[0]]} (weights sha1 {str(o[weights])[:12]})" for o in (then, now)
        )
        return (
            f"resume_from_checkpoint={checkpoint} started from another model, {started}, than this run's "
            f"{asked}: the reference (PALU's targets and KL, the reference terms of NPO, SimNPO, DPO and "
            "TPO) would change mid-run. Resume with model.model_args.pretrained_model_name_or_path="
            f"{then[STARTING_MODEL[0]]}, or start a new run in another paths.output_dir"
        )
    changed = [
        f"{key}: {then.get(key, '(unset)')!r} then, {now.get(key, '(unset)')!r} now"
        for key in sorted(set(then) | set(now), key=str)
        if then.get(key) != now.get(key) and key not in STARTING_MODEL  # a moved model folder resumes
    ]
    if not changed:
        return None
    return (
        f"resume_from_checkpoint={checkpoint} was trained under other options ({'; '.join(changed)}): resume "
        "with the options it was trained with, start a new run in another paths.output_dir, or add "
        f"+{ALLOW_OTHER_OPTIONS}=true to continue under these on purpose"
    )


def row_keys(dataset) -> list | None:
    """What identifies a dataset's rows: (question, answer) of QA rows, the text of raw-text chunks."""
    data = getattr(dataset, "data", None)
    if data is not None and hasattr(dataset, "question_key") and hasattr(dataset, "answer_key"):
        return list(zip(data[dataset.question_key], data[dataset.answer_key]))
    chunks = getattr(dataset, "chunks", None)
    return list(chunks) if chunks is not None else None


def dataset_fingerprint(dataset) -> str | None:
    """sha1 of what training reads from a dataset: tokens and roles of span datasets, rows otherwise."""
    digest = hashlib.sha1()
    items = getattr(dataset, "items", None)
    if isinstance(items, list) and items and "token_roles" in items[0]:
        for item in items:
            digest.update(item["input_ids"].numpy().tobytes() + b"|" + item["token_roles"].numpy().tobytes())
    elif (keys := row_keys(dataset)) is not None:
        digest.update(json.dumps(keys).encode())
    else:
        return None
    return digest.hexdigest()


def run_data(train_dataset) -> dict:
    """The forget and retain data of a run, as `CheckpointRecord` writes it into each checkpoint."""
    record = {}
    for part in ("forget", "retain"):
        dataset = getattr(train_dataset, part, None)
        if dataset is not None:
            record[part] = {"rows": len(dataset), "sha1": dataset_fingerprint(dataset)}
            if getattr(dataset, "span_annotations", None):
                record[part]["span_annotations"] = dataset.span_annotations
    return record


class CheckpointRecord(TrainerCallback):
    """Writes `record` as `file_name` into each checkpoint folder, for resuming to compare: the run's data
    (`run_data`) or options (`run_options`)."""

    def __init__(self, file_name: str, record: dict):
        self.file_name, self.record = file_name, record

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            (folder / self.file_name).write_text(json.dumps(self.record, indent=1))


def resume_data_problem(checkpoint: str, current: dict) -> tuple[str | None, str | None]:
    """(error, warning) for resuming `checkpoint` on the data `current` (a `run_data` record)."""
    path = Path(checkpoint) / RUN_DATA_FILE
    if not path.is_file():
        return None, (
            f"{checkpoint} has no {RUN_DATA_FILE} (written before palu-trainer recorded a run's data): "
            "resuming cannot check that it continues on the same forget and retain data"
        )
    saved, changed, details = json.loads(path.read_text()), [], []
    for part in ("forget", "retain"):
        then, now = saved.get(part, {}), current.get(part, {})
        if then.get("sha1") != now.get("sha1"):
            changed.append(part)
            details.append(f"{part}: {then.get('rows')} rows then, {now.get('rows')} now")
            if then.get("span_annotations") != now.get("span_annotations"):
                details[-1] += (
                    f", span file {then.get('span_annotations')} then, {now.get('span_annotations')} now"
                )
    if not changed:
        return None, None
    details = "; ".join(details)
    return (
        f"resume_from_checkpoint={checkpoint} was trained on other {' and '.join(changed)} data ({details}; "
        "split, span file, initiating options, max_length or tokenizer differ): resume with the options the "
        f"checkpoint was trained with, start a new run in another paths.output_dir, or add "
        f"+{ALLOW_OTHER_DATA}=true to continue on this data on purpose",
        None,
    )


def mid_epoch_warning(checkpoint: str) -> str | None:
    """A checkpoint saved in the middle of an epoch does not resume to an uninterrupted run's weights."""
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    epoch = state.get("epoch")
    if not isinstance(epoch, int | float) or abs(epoch - round(epoch)) < 1e-6:
        return None
    return (
        f"{checkpoint} was saved in the middle of an epoch (epoch {epoch:.3f}, step "
        f"{state.get('global_step')}): "
        "the resumed run draws other retain rows for its first batch (the framework samples them with the "
        "global RNG before the checkpoint's RNG state is restored) and will not end with an uninterrupted "
        "run's weights. Resume from a checkpoint at an epoch boundary for that (save_strategy=epoch)"
    )
