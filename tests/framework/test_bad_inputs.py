"""Bad inputs to palu-train and palu-eval: each stops before the first step, naming the option and
the fix; a few end-to-end runs show they stop before the reference cache (or before loading at all)."""

import copy
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from palu_trainer.framework.checkout import checkout_dir
from palu_trainer.framework.local_mirrors import redirect_to_local_mirrors
from palu_trainer.framework.registry import register

from ..conftest import make_tofu_mirror

BIN = Path(sys.executable).parent
SPANS = Path(__file__).resolve().parents[2] / "span_annotations"
QUICK_RUN = [
    "--config-name=unlearn.yaml",
    "+runtime=cpu",
    "model=tiny-llama",
    "experiment=unlearn/tofu/palu",
    "forget_split=forget01",
    "retain_split=retain99",
    "holdout_split=holdout01",
    f"span_annotations={SPANS / 'tofu_forget01.jsonl'}",
    "trainer.args.per_device_train_batch_size=4",
    "trainer.args.gradient_accumulation_steps=1",
    "trainer.args.do_eval=false",
    "trainer.args.eval_on_start=false",
    "trainer.args.eval_strategy=no",
    "trainer.args.report_to=none",
    "task_name=bad",
]


@functools.cache
def _base(choices: tuple[str, ...]):
    register()
    with initialize_config_dir(config_dir=str(checkout_dir() / "configs"), version_base=None):
        return compose(
            config_name="unlearn.yaml", overrides=["task_name=t", *choices], return_hydra_config=True
        )


def composed(overrides):
    """The config palu-train would run (with its `hydra` node), as the pre-checks see it.

    Config groups (`experiment=`, `trainer=`, `+best_model=`) are composed by Hydra, once per combination;
    the other overrides are set on a copy, values parsed as Hydra parses them (YAML scalars).
    """
    from palu_trainer.framework.checks import config_problems  # needs the framework importable

    groups = tuple(o for o in overrides if o.split("=")[0] in ("experiment", "trainer", "+best_model"))
    cfg = copy.deepcopy(_base(groups))
    for override in overrides:
        if override not in groups:
            key, value = override.lstrip("+").split("=", 1)
            OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    return cfg, config_problems


@pytest.fixture(scope="module")
def bad_places(tmp_path_factory):
    root = tmp_path_factory.mktemp("places")
    (root / "a_file").write_text("")
    (root / "interrupted" / "checkpoint-4").mkdir(parents=True)
    (root / "interrupted" / "checkpoint-8").mkdir()
    return root


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.method_args.gamma=-1"], r"^trainer\.method_args\.gamma=-1: must be a number >= 0"),
        (["trainer.method_args.alpha=-1"], r"alpha=-1: .*gradient ascent on the retain set"),
        (["trainer.method_args.gamma=abc"], r"gamma='abc': must be a number >= 0"),
        (
            ["trainer.method_args.reference_cache_max_gib=abc"],
            r"reference_cache_max_gib='abc': must be a number",
        ),
        (
            ["trainer=TPO", "trainer.method_args.beta=-1"],
            r"trainer\.method_args\.beta=-1: must be a number > 0",
        ),
        (["trainer=TPO", "trainer.method_args.beta=0"], r"beta=0: must be a number > 0 .*divides by zero"),
        (["trainer=TPO", "trainer.method_args.alpha=-1"], r"alpha=-1: must be a number >= 0"),
        (
            ["+trainer.method_args.topk=5"],
            r"^trainer\.method_args\.topk is not an option of PALUTrainer: did you mean top_k\? its options "
            r"are alpha, gamma, kl_direction",
        ),
        (["+trainer.method_args.num_initiating_tokens=2"], r"top-level `num_initiating_tokens=N`"),
        (["+trainer.args.max_steps=0"], r"trainer\.args\.max_steps=0: give a number of optimizer steps >= 1"),
        (
            ["trainer=NPO"],
            r"trainer=NPO cannot train on experiment=unlearn/tofu/palu's forget set .*use "
            r"experiment=unlearn/tofu/default trainer=NPO",
        ),
        (
            ["data.forget.TOFU_QA_forget_spans.args.max_length=0"],
            r"data\.forget\.TOFU_QA_forget_spans\.args\.max_length=0: must be an integer >= 1 \(tokens "
            r"kept per row or chunk; 0 does not mean 'no truncation'",
        ),
        (
            ["min_initiating_tokens=abc"],
            r"TOFU_QA_forget_spans\.args\.min_initiating_tokens='abc': give auto",
        ),
        (["data.retain.TOFU_QA_retain.args.max_length=-5"], r"TOFU_QA_retain\.args\.max_length=-5"),
        (["initiating_ratio=0.25"], r"initiating_ratio=0\.25 has no effect with initiating_strategy=first_n"),
        (
            ["initiating_strategy=all", "num_initiating_tokens=1"],
            r"num_initiating_tokens=1 has no effect with initiating_strategy=all",
        ),
        (["paths.output_dir={places}/a_file/run"], r"paths\.output_dir=.*a_file is a file, not a folder"),
        (["paths.output_dir=/proc/palu_run"], r"paths\.output_dir=/proc/palu_run: cannot write there"),
        (
            ["model.model_args.pretrained_model_name_or_path={places}/interrupted"],
            r"interrupted is an interrupted run's folder: .*no final model \(no config\.json\)\. Use a "
            r"checkpoint, e\.g\. .*interrupted/checkpoint-8",
        ),
        (
            ["model.model_args.pretrained_model_name_or_path={places}/nothing"],
            r"pretrained_model_name_or_path=.*/nothing: no such folder",
        ),
        (["+peft.r=0"], r"^peft\.r=0: must be an integer >= 1 \(the adapters' rank\)"),
        (["+peft.rank=8"], r"^peft\.rank is not an option of LoRA \(\+peft=lora\): its options are alpha"),
        (["+peft.dropout=1.5"], r"^peft\.dropout=1\.5: must be a number >= 0 and < 1"),
        (
            ["+best_model=fq_at_mu_floor", "best_model.mu_share=2"],
            r"^best_model\.mu_share=2: must be a number",
        ),
        (
            ["+best_model=fq_mu_mean", "trainer.args.eval_strategy=steps"],
            r"^trainer\.args\.eval_strategy=steps undoes best_model, which needs epoch \(keep what configs/",
        ),
        (
            ["+best_model=fq_at_mu_floor", "trainer.args.metric_for_best_model=loss"],
            r"^trainer\.args\.metric_for_best_model=loss undoes best_model, which needs palu_selection",
        ),
    ],
)
def test_config_checks_name_the_option_and_the_fix(overrides, message, bad_places, tmp_path):
    import re

    overrides = [override.format(places=bad_places) for override in overrides]
    base = ["experiment=unlearn/tofu/palu", "task_name=t", f"paths.output_dir={tmp_path / 'out'}"]
    cfg, config_problems = composed(base + overrides)
    problems = config_problems(cfg, "train")
    assert len(problems) == 1 and re.search(message, problems[0]), problems


# The third sweep (issue 29): the Trainer's numeric and named arguments, the stock trainers' method_args and
# settings that train nothing. Before it, each loaded the model and then failed with a traceback, or
# trained and saved the original model with exit 0.
STOCK = "experiment=unlearn/tofu/default"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.args.gradient_accumulation_steps=0"],
            r"gradient_accumulation_steps=0: must be an integer >= 1",
        ),
        (
            ["trainer.args.per_device_train_batch_size=0"],
            r"per_device_train_batch_size=0: must be an integer >= 1",
        ),
        (
            ["trainer.args.per_device_train_batch_size=2.5"],
            r"per_device_train_batch_size=2\.5: must be an integer",
        ),
        (
            ["trainer.args.learning_rate=0"],
            r"learning_rate=0: must be a number > 0 \(0 trains nothing and saves",
        ),
        (["trainer.args.learning_rate=-1.0e-5"], r"learning_rate=-1e-05: .*a negative rate ascends every"),
        (["trainer.args.learning_rate=abc"], r"learning_rate='abc': must be a number > 0"),
        (["trainer.args.num_train_epochs=0"], r"num_train_epochs=0: must be a number > 0 \(0 trains nothing"),
        (["trainer.args.warmup_ratio=2"], r"warmup_ratio=2: must be a number >= 0 and <= 1"),
        (["+trainer.args.warmup_steps=-3"], r"warmup_steps=-3: must be an integer >= 0"),
        (["trainer.args.weight_decay=-0.1"], r"weight_decay=-0\.1: must be a number >= 0"),
        (["+trainer.args.adam_beta1=1.5"], r"adam_beta1=1\.5: must be a number >= 0 and < 1"),
        (["+trainer.args.adam_epsilon=0"], r"adam_epsilon=0: must be a number > 0 .*divides by zero"),
        (
            ["+trainer.args.max_grad_norm=-1"],
            r"max_grad_norm=-1: must be a number >= 0 \(.*0 turns clipping off",
        ),
        (["trainer.args.logging_steps=0"], r"logging_steps=0: must be a number > 0"),
        (
            ["trainer.args.save_strategy=steps", "+trainer.args.save_steps=0"],
            r"save_steps=0: must be a number > 0",
        ),
        (
            ["+trainer.args.save_total_limit=0"],
            r"save_total_limit=0: must be an integer >= 1 \(.*null keeps all",
        ),
        (["trainer.args.seed=-1"], r"seed=-1: must be an integer >= 0 and <= 4294967295"),
        (["+trainer.args.dataloader_num_workers=-1"], r"dataloader_num_workers=-1: must be an integer >= 0"),
        (
            ["+trainer.args.lr_scheduler_type=linar"],
            r"^trainer\.args\.lr_scheduler_type='linar'; did you mean linear\? choose one of linear, cosine",
        ),
        (
            ["trainer.args.optim=adamw_torc"],
            r"optim='adamw_torc'; did you mean adamw_torch\? choose one of ",
        ),
        (["trainer.args.save_strategy=sometimes"], r"save_strategy='sometimes'; choose one of no, steps"),
        (
            ["trainer.method_args.gamma=0", "trainer.method_args.alpha=0"],
            r"^trainer\.method_args\.gamma=0 with alpha=0: every term of the loss has weight 0, so the run "
            r"trains nothing",
        ),
        (
            ["trainer.method_args.gamma=0", "trainer.method_args.retain_loss_type=none"],
            r"gamma=0 with retain_loss_type=none: every term of the loss has weight 0",
        ),
        (
            ["trainer.method_args.reference_cache_top_m=0"],
            r"reference_cache_top_m=0: must be an integer >= 1 \(m: P_ref.s entries kept per common",
        ),
        (
            ["trainer.method_args.reference_cache=maybe"],
            r"reference_cache='maybe'; choose one of auto, true, false",
        ),
        (["trainer.method_args.target_gradient=1"], r"target_gradient=1; choose one of true, false"),
        (["trainer.method_args.top_k=-3"], r"top_k=-3: give a positive integer K, `all`, or a share"),
        (
            ["trainer.method_args.retain_loss_type=MSE"],
            r"retain_loss_type='MSE'; choose one of NLL, KL, none",
        ),
        (
            [STOCK, "trainer=NPO", "trainer.method_args.beta=0"],
            r"beta=0: must be a number > 0 \(NPO's temperature; 0 divides",
        ),
        (
            [STOCK, "trainer=SimNPO", "trainer.method_args.beta=-1"],
            r"beta=-1: must be a number > 0 \(SimNPO's",
        ),
        ([STOCK, "trainer=NPO", "trainer.method_args.alpha=-1"], r"alpha=-1: must be a number >= 0"),
        (
            [STOCK, "trainer=GradDiff", "+trainer.method_args.gama=0"],
            r"^trainer\.method_args\.gama is not an option of GradDiff: did you mean gamma\? its options are "
            r"alpha, gamma, retain_loss_type$",
        ),
        (
            [STOCK, "trainer=GradDiff", "trainer.method_args.retain_loss_type=MSE"],
            r"retain_loss_type='MSE'; choose one of NLL, KL$",
        ),
        (
            [STOCK, "trainer=GradDiff", "trainer.method_args.gamma=0", "trainer.method_args.alpha=0"],
            r"gamma=0 with alpha=0: every term of the loss has weight 0",
        ),
    ],
)
def test_trainer_arguments_and_settings_that_train_nothing_are_refused(overrides, message, tmp_path):
    import re

    experiment = next((o for o in overrides if o.startswith("experiment=")), "experiment=unlearn/tofu/palu")
    rest = [o for o in overrides if not o.startswith("experiment=")]
    cfg, config_problems = composed(
        [experiment, "task_name=t", f"paths.output_dir={tmp_path / 'out'}", *rest]
    )
    problems = config_problems(cfg, "train")
    assert len(problems) == 1 and re.search(message, problems[0]), problems


def test_settings_with_a_real_use_are_warned_about(tmp_path):
    from palu_trainer.framework.checks import CONFIG_WARNINGS

    def warnings(*overrides):
        cfg, config_problems = composed(
            ["experiment=unlearn/tofu/palu", f"paths.output_dir={tmp_path}", *overrides]
        )
        assert config_problems(cfg, "train") == []
        return config_problems(cfg, "train", CONFIG_WARNINGS)

    assert warnings() == []
    (retain_only,) = warnings("trainer.method_args.gamma=0")
    assert "only fine-tunes on the retain set and unlearns nothing (a control run)" in retain_only
    (no_training,) = warnings("trainer.args.do_train=false")
    assert "do_train=false: the run trains nothing and saves no model" in no_training


@pytest.mark.parametrize(("trainer", "fix"), [("PALU", "unlearn/tofu/palu"), ("TPO", "unlearn/tofu/tpo")])
def test_palu_or_tpo_on_the_stock_forget_set_stops_before_loading(trainer, fix, tmp_path):
    """The fourth sweep's last row: the sentence used to come at the end of a traceback, after loading."""
    cfg, config_problems = composed(
        [
            "experiment=unlearn/tofu/default",
            f"trainer={trainer}",
            "task_name=t",
            f"paths.output_dir={tmp_path}",
        ]
    )
    assert config_problems(cfg, "train") == [
        f"trainer={trainer} reads span roles in the forget batches, which experiment=unlearn/tofu/default's "
        f"forget set (TOFU_QA_forget) does not make: use experiment={fix} (its span-annotated forget set and "
        "collator)"
    ]


def test_good_configs_pass_the_checks(tmp_path):
    for overrides in (
        [],
        ["initiating_strategy=ratio", "initiating_ratio=0.25"],
        ["initiating_strategy=random_n", "num_initiating_tokens=1", "initiating_seed=4"],
        ["trainer=TPO", "trainer.method_args.gamma=0"],
        ["trainer=PALU_release", "+trainer.args.max_steps=5"],
        [
            "+trainer.args.max_grad_norm=0",
            "+trainer.args.save_total_limit=null",
            "trainer.args.logging_steps=0.1",
        ],
        ["trainer.args.save_strategy='no'", "+trainer.args.save_steps=0", "trainer.method_args.top_k=all"],
    ):
        cfg, config_problems = composed(
            ["experiment=unlearn/tofu/palu", "task_name=t", f"paths.output_dir={tmp_path}", *overrides]
        )
        assert config_problems(cfg, "train") == [], overrides


class QASet(SimpleNamespace):
    def __len__(self):
        return len(self.data["question"])


def qa_set(questions):
    answers = [f"a {q}" for q in questions]
    return QASet(
        data={"question": questions, "answer": answers}, question_key="question", answer_key="answer"
    )


def test_forget_rows_in_the_retain_set_are_named():
    from palu_trainer.framework.checks import forget_retain_overlap

    data = SimpleNamespace(forget=qa_set(["q1", "q2", "q3"]), retain=qa_set(["q0", "q2", "q3", "q4"]))
    message = forget_retain_overlap(data, "forget05", "retain99")
    assert message.startswith("forget_split=forget05 and retain_split=retain99 share 2 of the 3 forget rows")
    assert "e.g. 'q2'" in message and "+allow_forget_retain_overlap=true" in message
    assert forget_retain_overlap(SimpleNamespace(forget=qa_set(["q1"]), retain=qa_set(["q0"]))) is None


def test_resuming_on_other_data_is_refused(tmp_path):
    from palu_trainer.framework.provenance import (
        RUN_DATA_FILE,
        CheckpointRecord,
        resume_data_problem,
        run_data,
    )

    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    before = run_data(SimpleNamespace(forget=qa_set(["q1", "q2"]), retain=qa_set(["r1"])))
    args, state = (
        SimpleNamespace(output_dir=str(tmp_path)),
        SimpleNamespace(global_step=2, is_world_process_zero=True),
    )
    CheckpointRecord(RUN_DATA_FILE, before).on_save(args, state, None)
    assert resume_data_problem(str(checkpoint), before) == (None, None)
    after = run_data(SimpleNamespace(forget=qa_set(["q1", "q3"]), retain=qa_set(["r1"])))
    error, _ = resume_data_problem(str(checkpoint), after)
    assert error.startswith(
        f"resume_from_checkpoint={checkpoint} was trained on other forget data (forget: 2 rows"
    )
    assert "+allow_resume_on_other_data=true" in error
    (checkpoint / "palu_run_data.json").unlink()
    error, warning = resume_data_problem(str(checkpoint), after)
    assert error is None and "cannot check that it continues on the same forget and retain data" in warning


def test_a_mid_epoch_checkpoint_is_warned_about(tmp_path):
    from palu_trainer.framework.provenance import mid_epoch_warning

    (tmp_path / "trainer_state.json").write_text(json.dumps({"epoch": 0.2, "global_step": 2}))
    warning = mid_epoch_warning(str(tmp_path))
    assert "was saved in the middle of an epoch (epoch 0.200, step 2)" in warning
    assert "will not end with an uninterrupted run's weights" in warning
    (tmp_path / "trainer_state.json").write_text(json.dumps({"epoch": 2.0, "global_step": 20}))
    assert mid_epoch_warning(str(tmp_path)) is None


def stub_model(rows):
    return SimpleNamespace(
        get_input_embeddings=lambda: torch.nn.Embedding(rows, 2),
        config=SimpleNamespace(vocab_size=rows),
        name_or_path="model-dir",
    )


class StubTokenizer(list):
    name_or_path = "tokenizer-dir"


@pytest.mark.parametrize(
    ("tokens", "rows", "error", "warning"),
    [
        (4096, 2048, r"has 4096 tokens but the model model-dir has 2048 vocabulary rows: .*IndexError", None),
        (1024, 2048, r"has 1024 tokens, 50% of the 2048 vocabulary rows .*another model's tokenizer", None),
        (32011, 32064, None, r"32011 tokens and the model model-dir 32064 vocabulary rows: 53 rows no token"),
        (2048, 2048, None, None),  # a tokenizer padded with unused tokens up to the model's size
    ],
)
def test_tokenizer_and_model_vocabularies(tokens, rows, error, warning):
    import re

    from palu_trainer.framework.patches import checking_vocabulary
    from palu_trainer.training.vocabulary import reachable_vocab_size, vocabulary_mismatch

    found_error, found_warning = vocabulary_mismatch(tokens, rows, "tokenizer-dir", "model-dir")
    assert (found_error is None) == (error is None) and (found_warning is None) == (warning is None)
    assert error is None or re.search(error, found_error)
    assert warning is None or re.search(warning, found_warning)
    tokenizer = StubTokenizer(range(tokens))
    if error is None:
        # K's share is taken of the tokens the tokenizer reaches, not of the padded rows
        assert reachable_vocab_size(stub_model(rows), tokenizer) == min(tokens, rows)
    else:
        from palu_trainer.framework.checks import BadInput

        with pytest.raises(BadInput, match=error):
            checking_vocabulary(lambda cfg: (stub_model(rows), tokenizer))({})


def test_offline_hint_names_tofu_dir_and_the_mirror_checks_its_files(tmp_path, tofu_dir):
    from palu_trainer.framework.local_mirrors import hub_hint

    error = ConnectionError("Couldn't reach 'locuslab/TOFU' on the Hub (ConnectionError)")
    assert "Offline, set TOFU_DIR=/path to a local copy" in hub_hint(error, {})
    assert hub_hint(error, {"TOFU_DIR": "/x"}) is None and hub_hint(ValueError("other"), {}) is None
    mirror = make_tofu_mirror(tmp_path / "tofu", tofu_dir, {"holdout01": [{"question": "q", "answer": "a"}]})
    (mirror / "retain99.json").unlink()
    overrides = ["forget_split=forget01", "retain_split=retain99", "holdout_split=holdout01"]
    cfg, _ = composed(["experiment=unlearn/tofu/palu", *overrides])
    with pytest.raises(
        FileNotFoundError,
        match=r"the README lists config 'retain99' \(split 'train', needed by data\.retain\..*\) in "
        r"\['retain99\.json'\], which the folder lacks",
    ):
        redirect_to_local_mirrors(cfg, {"TOFU_DIR": str(mirror)})


def test_runtime_without_plus_is_explained():
    from palu_trainer.framework.checks import argv_problem

    assert "write `+runtime=cpu`" in argv_problem(["experiment=x", "runtime=cpu"])
    assert argv_problem(["+runtime=cpu"]) is None


# End to end: palu-train and palu-eval stop with exit 1 and the message, before the reference cache.


def run(command, overrides, tofu_mirror, model_dir, out_dir, script="palu-train", **environ):
    env = {**os.environ, "TOFU_DIR": str(tofu_mirror), "OMP_NUM_THREADS": "1", **environ}
    env = {key: value for key, value in env.items() if value is not None}
    models = [
        f"model.{args}.pretrained_model_name_or_path={model_dir}" for args in ("model_args", "tokenizer_args")
    ]
    argv = [str(BIN / script), *command, f"paths.output_dir={out_dir}", *models, *overrides]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.slow
def test_palu_train_refuses_bad_options_before_loading(tmp_path, tiny_model_dir, tofu_mirror):
    code, output = run(
        QUICK_RUN,
        ["trainer.method_args.alpha=-1", "+trainer.method_args.topk=5"],
        tofu_mirror,
        tiny_model_dir,
        tmp_path,
    )
    assert code == 1
    assert (
        "palu-train: trainer.method_args.topk is not an option of PALUTrainer: did you mean top_k?" in output
    )
    assert "local dataset mirror" not in output and "reference_cache=auto" not in output  # before loading


@pytest.mark.slow
def test_palu_train_refuses_overlapping_forget_and_retain_before_the_trainer(
    tmp_path, tiny_model_dir, tofu_mirror
):
    overlap = [
        "forget_split=forget05",
        f"span_annotations={SPANS / 'tofu_forget05.jsonl'}",
        "+trainer.args.max_steps=1",
    ]
    code, output = run(QUICK_RUN, overlap, tofu_mirror, tiny_model_dir, tmp_path)
    assert code == 1
    assert (
        "palu-train: forget_split=forget05 and retain_split=retain99 share 160 of the 200 forget rows"
        in output
    )
    assert "reference_cache=auto" not in output  # the trainer (and its cache estimate) was never built
    assert "Traceback" not in output


@pytest.mark.slow
def test_resuming_on_other_forget_data_stops_and_a_mid_epoch_checkpoint_warns(
    tmp_path, tiny_model_dir, tofu_mirror
):
    first = ["+trainer.args.max_steps=2", "trainer.args.save_strategy=steps", "+trainer.args.save_steps=2"]
    code, output = run(QUICK_RUN, first, tofu_mirror, tiny_model_dir, tmp_path)
    assert code == 0, output[-3000:]
    assert (tmp_path / "checkpoint-2" / "palu_run_data.json").is_file()
    resumed = [
        "+trainer.args.max_steps=4",
        "+trainer.args.resume_from_checkpoint=true",
        "initiating_strategy=all",
    ]
    code, output = run(QUICK_RUN, resumed, tofu_mirror, tiny_model_dir, tmp_path)
    assert code == 1
    assert "checkpoint-2 was saved in the middle of an epoch (epoch 0.200, step 2)" in output
    assert (
        f"palu-train: resume_from_checkpoint={tmp_path}/checkpoint-2 was trained on other forget data"
        in output
    )
    assert "the reference cache" not in output and "Traceback" not in output


@pytest.mark.slow
def test_offline_without_tofu_dir_says_tofu_dir(tmp_path, tiny_model_dir, tofu_mirror):
    code, output = run(
        QUICK_RUN, [], tofu_mirror, tiny_model_dir, tmp_path, TOFU_DIR=None, HF_DATASETS_OFFLINE="1"
    )
    assert code == 1 and "palu-train: locuslab/TOFU could not be loaded (" in output
    assert "Offline, set TOFU_DIR=/path to a local copy of it" in output


@pytest.mark.slow
def test_palu_eval_on_an_interrupted_run_names_its_checkpoint(tmp_path, tiny_model_dir, tofu_mirror):
    (tmp_path / "run" / "checkpoint-6").mkdir(parents=True)
    command = ["experiment=eval/tofu/default", "+runtime=cpu", "model=tiny-llama", "task_name=e"]
    code, output = run(command, [], tofu_mirror, tmp_path / "run", tmp_path / "eval", script="palu-eval")
    assert code == 1
    assert "is an interrupted run's folder: it holds checkpoints but no final model" in output
    assert "run/checkpoint-6" in output and "Unrecognized model" not in output


def test_a_checkpoint_records_a_stock_methods_options_and_loras_and_a_resume_compares_them(tmp_path):
    from palu_trainer.framework.provenance import RUN_OPTIONS_FILE, resume_options_problem, run_options

    cfg, _ = composed(["experiment=unlearn/tofu/default", "trainer=NPO", f"paths.output_dir={tmp_path}"])
    OmegaConf.update(cfg, "peft", {"r": 16, "alpha": 32}, force_add=True)
    options = run_options(cfg)
    assert options["trainer"] == "NPO" and options["peft.r"] == 16 and "trainer.method_args.beta" in options
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    torch.save({"state": {}}, checkpoint / "optimizer.pt")
    (checkpoint / RUN_OPTIONS_FILE).write_text(json.dumps(options))
    OmegaConf.update(cfg, "trainer.args.resume_from_checkpoint", True, force_add=True)
    assert resume_options_problem(cfg, "train") is None
    cfg.peft.r = 8
    assert "(peft.r: 16 then, 8 now)" in resume_options_problem(cfg, "train")
    OmegaConf.update(cfg, "allow_resume_under_other_options", True, force_add=True)
    assert resume_options_problem(cfg, "train") is None


def test_a_resume_from_another_starting_model_of_the_same_shape_stops_naming_both(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    from palu_trainer.framework.provenance import RUN_OPTIONS_FILE, resume_options_problem, run_options

    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    weights = load_file(other / "model.safetensors")
    name = sorted(weights)[len(weights) // 2]
    weights[name] = weights[name] + 1e-3  # same shape, tokenizer and config: another model all the same
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    run_dir = tmp_path / "run"
    cfg, _ = composed(["experiment=unlearn/tofu/palu", f"paths.output_dir={run_dir}"])
    OmegaConf.update(cfg, "model.model_args.pretrained_model_name_or_path", str(tiny_model_dir))
    options = run_options(cfg)
    assert options["model"] == str(tiny_model_dir) and len(options["model weights"]) == 40
    checkpoint = run_dir / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    torch.save({"state": {}}, checkpoint / "optimizer.pt")
    (checkpoint / RUN_OPTIONS_FILE).write_text(json.dumps(options))
    OmegaConf.update(cfg, "trainer.args.resume_from_checkpoint", True, force_add=True)
    assert resume_options_problem(cfg, "train") is None
    OmegaConf.update(cfg, "model.model_args.pretrained_model_name_or_path", str(other))
    problem = resume_options_problem(cfg, "train")
    assert problem.startswith(
        f"resume_from_checkpoint={checkpoint} started from another model, {tiny_model_dir}"
    )
    assert f"than this run's {other} (weights sha1 " in problem
    assert problem.endswith(
        f"pretrained_model_name_or_path={tiny_model_dir}, or start a new run in another paths.output_dir"
    )


def test_palu_eval_on_the_folder_of_a_run_still_going_says_so_not_interrupted(tmp_path):
    """A folder whose run still holds its lock (this process: alive) is being written, whether its final
    save is under way or it is still training; a gone run's lock is no reason to refuse."""
    import socket

    from palu_trainer.training.run_lock import LOCK_FILE

    folder = tmp_path / "run"
    (folder / "checkpoint-4").mkdir(parents=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": 0, "command": "palu-train ..."}
    (folder / LOCK_FILE).write_text(json.dumps(record))
    cfg, problems = composed(
        ["experiment=eval/tofu/default", f"model.model_args.pretrained_model_name_or_path={folder}"]
    )
    (problem,) = [p for p in problems(cfg, "eval") if p.startswith("model.model_args")]
    key = "model.model_args.pretrained_model_name_or_path"
    assert problem.startswith(
        f"{key}={folder} belongs to a run that is still going (process {os.getpid()} on "
    )
    assert problem.endswith("evaluate the folder once that run has finished")
    record["pid"] = 2**22 + 1  # above pid_max: a run that is gone
    (folder / LOCK_FILE).write_text(json.dumps(record))
    (problem,) = [p for p in problems(cfg, "eval") if p.startswith("model.model_args")]
    assert "is an interrupted run's folder" in problem
