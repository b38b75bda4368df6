"""Two processes on CPU, as users run several GPUs: DeepSpeed ZeRO-3 (the framework's config, via accelerate)
and plain DDP (torchrun), against one process with gradient accumulation over the same rows.

The ranks' micro-batches are uneven, as real data makes them: one forget row has spans and a long answer,
the other none and a short one, so in every step one rank has no initiating position and the ranks need
different numbers of projection chunks (|V| = 128256, Llama-3's: 32 positions per chunk). Gradient
checkpointing is on, output embeddings tied and untied. A 2-row forget set makes each step hold both rows
(one per process, or both in one process with gradient accumulation 2) and a 1-row retain set the same
retain row, so the one-process run sees the same batches and its losses are the reference.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from palu_trainer.framework.checkout import checkout_dir
from palu_trainer.framework.launch import free_port, shared_memory_op_dir, write_accelerate_config
from palu_trainer.method.chunking import chunk_count, logit_chunk_rows
from palu_trainer.method.reference_cache import count_positions
from palu_trainer.method.roles import label_positions
from palu_trainer.spans.format import write_annotations
from palu_trainer.spans.tpo_spans import read_tpo
from palu_trainer.training.run_folder import FAILED_RUN_FILE
from palu_trainer.training.run_lock import LOCK_FILE

from ..conftest import TAG_TEMPLATE, make_tofu_mirror, read_jsonl, tied_and_untied_models
from .test_datasets import span_dataset
from .test_integration import PALU_TRAIN, QUICK_RUN
from .test_run_faults import preempted_after

BIN = Path(sys.executable).parent
FORGET_ROWS = 2
GRADIENT_CHECKPOINTING = ["trainer.args.gradient_checkpointing=true"]
STEPS = 3
VOCABULARY = 128256
SPANNED_ROW = 8  # forget01's longest answer (4 spans); the other row, its shortest, gets none
PALU = ["experiment=unlearn/tofu/palu"]
LORA = ["+peft=lora", "peft.dropout=0"]  # no dropout: the ranks' random masks differ from one process's
# (experiment overrides, tied output embeddings)
CONFIGURATIONS = {
    "PALU-reference-cache-tied": ([*PALU, "trainer.method_args.reference_cache=true"], True),
    "PALU-reference-model-untied": ([*PALU, "trainer.method_args.reference_cache=false"], False),
    "TPO-tied": (["experiment=unlearn/tofu/tpo"], True),
    # LoRA: PALU as users run it (its cache, built from the model with its adapters disabled), and a stock
    # method whose reference in every step is the model with its adapters disabled
    "PALU-reference-cache-LoRA-tied": ([*PALU, "trainer.method_args.reference_cache=true", *LORA], True),
    "NPO-LoRA-untied": (["experiment=unlearn/tofu/default", "trainer=NPO", *LORA], False),
}
DDP_CONFIGURATION = "PALU-reference-cache-tied"
STACK_CONFIGURATIONS = ("PALU-reference-cache-tied", "PALU-reference-cache-LoRA-tied")
LOGGED = {
    "PALU": ("loss", "local_loss", "kl_loss", "retain_loss", "grad_norm"),
    "TPO": ("loss", "grad_norm"),
    "NPO": ("loss", "grad_norm"),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tofu_rows):
    return tied_and_untied_models(tmp_path_factory, tofu_rows, VOCABULARY)


@pytest.fixture(scope="module")
def uneven_data(tmp_path_factory, tofu_dir, shared_dir):
    root = tmp_path_factory.mktemp("distributed")
    forget = read_jsonl(tofu_dir / "forget01.json")
    forget = [forget[SPANNED_ROW], min(forget, key=lambda row: len(row["answer"]))]
    retain = read_jsonl(tofu_dir / "retain99.json")[:1]
    mirror = make_tofu_mirror(
        root / "tofu", tofu_dir, {"forget01": forget, "retain99": retain, "holdout01": retain}
    )
    _, spans = read_tpo(shared_dir / "data" / "tofu_spans_gpt4o" / "forget01.jsonl")
    annotations = root / "forget01.jsonl"
    write_annotations(annotations, [row["answer"] for row in forget], [spans[SPANNED_ROW], []])
    return mirror, annotations, forget, spans[SPANNED_ROW], retain[0]


def test_the_ranks_need_different_projection_calls(uneven_data, model_dirs, tmp_path):
    """The premise of the runs below: per rank, different chunk counts for each role, zero on one."""
    _, _, forget, spans, retain = uneven_data
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[True])
    rows = span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, forget, [spans, []], n=3)
    chunk_rows = logit_chunk_rows(VOCABULARY)
    assert chunk_rows == 32
    counts = [count_positions([rows[i]["token_roles"]]) for i in range(FORGET_ROWS)]
    initiating_chunks = [chunk_count(initiating, chunk_rows) for initiating, _ in counts]
    common_chunks = [chunk_count(common, chunk_rows) for _, common in counts]
    print("initiating/common positions per row:", counts)
    assert initiating_chunks[0] >= 1 and initiating_chunks[1] == 0
    assert common_chunks[0] > common_chunks[1] >= 1
    retain_rows = span_dataset(tmp_path, tokenizer, TAG_TEMPLATE, [retain], [[]], min_initiating_tokens=0)
    labels = torch.stack([retain_rows[0]["labels"]])
    assert chunk_count(len(label_positions(labels)), chunk_rows) >= 2


@pytest.fixture(scope="module")
def zero3_config(tmp_path_factory):
    """The ZeRO-3 launch config, once DeepSpeed's CPU shared-memory op is built (`make setup` builds it; a
    fresh venv builds it here, outside the launches' timeouts). A build that never ends is a lock left by
    a killed one, on which every launch would wait: named, rather than three timeouts."""
    build = [sys.executable, "-m", "palu_trainer.framework.launch"]
    try:
        subprocess.run(build, check=True, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        lock = shared_memory_op_dir() / "lock"
        pytest.fail(
            f"DeepSpeed's CPU shared-memory op did not build in 600 s: if {lock} is a killed build's, "
            "delete it"
        )
    return write_accelerate_config(tmp_path_factory.mktemp("zero3"), num_processes=2, bf16="auto")


def fault_stacks(stderr: str) -> str:
    """The fault handler's thread stacks of a rank that aborted, which the list of extension modules after
    them pushes out of the last 8,000 characters (CI's third sighting of the abort at exit lost them so)."""
    start = stderr.find("Fatal Python error")
    if start < 0:
        return ""
    end = stderr.find("Extension modules", start)
    return "\n--- fault handler ---\n" + stderr[start : end if end > 0 else start + 8000][:8000] + "\n---\n"


def launch(launcher, overrides, data, model_dir, out_dir, processes, steps=STEPS):
    """The command line and environment of a run of `steps` steps on `processes` ranks (under the
    framework's src/train.py, which reads no TOFU_DIR, the data's paths on the command line)."""
    mirror, annotations, *_ = data
    spans = [] if "trainer=NPO" in overrides else [f"span_annotations={annotations}"]
    if launcher[-1] == str(checkout_dir() / "src" / "train.py"):
        spans += [
            f"data.forget.TOFU_QA_forget_spans.args.hf_args.path={mirror}",
            f"data.retain.TOFU_QA_retain.args.hf_args.path={mirror}",
            "~eval",
            "~eval.tofu",
        ]
    command = [
        *launcher,
        *QUICK_RUN,
        *spans,
        "task_name=distributed",
        f"paths.output_dir={out_dir}",
        f"++trainer.args.max_steps={steps}",
        "trainer.args.per_device_train_batch_size=1",
        f"trainer.args.gradient_accumulation_steps={FORGET_ROWS // processes}",
        *GRADIENT_CHECKPOINTING,
        *[
            f"model.{args}.pretrained_model_name_or_path={model_dir}"
            for args in ("model_args", "tokenizer_args")
        ],
        *overrides,
    ]
    if processes > 1:
        # the CPU's backend, named (docs/operations.md): accelerate >= 1.0 (transformers 5's stack) leaves a
        # DeepSpeed launch on a machine without GPUs with none, counts one process, and DeepSpeed stops
        # ("train_batch_size is not equal to ... 1 != 1 * 1 * 2"); in one process a backend fails instead
        command.append("+trainer.args.ddp_backend=gloo")
    # PYTHONFAULTHANDLER: a rank that aborts at exit ("terminate called without an active exception", seen
    # twice on a loaded machine after every step had finished) prints every thread's Python stack.
    env = {
        **os.environ,
        "TOFU_DIR": str(mirror),
        "LOCAL_SIZE": str(processes),
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
    }
    return command, env


def run(launcher, overrides, data, model_dir, out_dir, processes):
    command, env = launch(launcher, overrides, data, model_dir, out_dir, processes)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + fault_stacks(result.stderr) + result.stderr[-8000:]
    history = json.loads((out_dir / "trainer_state.json").read_text())["log_history"]
    return [entry for entry in history if "loss" in entry], load_file(out_dir / "model.safetensors")


@pytest.fixture(scope="module")
def single_process(request, tmp_path_factory, uneven_data, model_dirs):
    """Reference runs of the configurations this session runs: one process each, both rows in each step
    through gradient accumulation. Made up front, two at a time, since each takes one core of the two that
    the distributed runs take after them."""
    selected = {
        item.callspec.params["configuration"] if hasattr(item, "callspec") else DDP_CONFIGURATION
        for item in request.session.items
        if item.module.__name__ == __name__ and "single_process" in item.fixturenames
    }

    def reference(configuration):
        overrides, tied = CONFIGURATIONS[configuration]
        out = tmp_path_factory.mktemp(f"single-{configuration}")
        return run([str(PALU_TRAIN)], overrides, uneven_data, model_dirs[tied], out, processes=1)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(selected, pool.map(reference, selected)))


def assert_same_run(configuration, distributed, single, model_dir):
    """Losses to 1e-4 relative. Gradient norms to 1e-3: each sums |V|·d = 8.2M squared entries per
    embedding, partitioned across ranks under ZeRO-3 (measured differences up to 5e-4). Weights: each
    tensor's update (from the initial weights) to 10% of its size, since Adam divides tiny gradients by
    their own scale, so rounding in the smallest gradients moves single entries by up to lr (measured
    worst tensors: 2.8% PALU cache, 2.1% reference model, 4.9% TPO under ZeRO-3; 0 under DDP)."""
    (steps, weights), (single_steps, single_weights) = distributed, single
    assert len(steps) == len(single_steps) == STEPS
    for step, (entry, single_entry) in enumerate(zip(steps, single_steps)):
        for key in LOGGED[configuration.split("-")[0]]:
            print(
                f"{configuration} step {step} {key}: 2 processes {entry[key]}, 1 process {single_entry[key]}"
            )
            relative = 1e-3 if key == "grad_norm" else 1e-4
            assert entry[key] == pytest.approx(single_entry[key], rel=relative, abs=1e-6), (step, key)
    if configuration.startswith("PALU"):
        assert all(
            entry["n_initiating"] == single["n_initiating"] > 0 for entry, single in zip(steps, single_steps)
        )
    initial = load_file(model_dir / "model.safetensors")
    assert weights.keys() == initial.keys()
    for name, tensor in weights.items():
        assert tensor.shape == initial[name].shape, name  # gathered, not a ZeRO-3 shard
        update, single_update = tensor - initial[name], single_weights[name] - initial[name]
        if "LoRA" in configuration and not name.endswith("proj.weight"):  # frozen: only adapters train
            assert float(update.norm()) == float(single_update.norm()) == 0, name
            continue
        assert float(single_update.norm()) > 0, name
        assert float((update - single_update).norm()) <= 0.1 * float(single_update.norm()), name


def zero3_launcher(zero3_config, port=None, entry_point="palu-train") -> list[str]:
    """accelerate with DeepSpeed ZeRO-3 on 2 ranks, launching palu-train or the framework's src/train.py."""
    return [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(zero3_config),
        "--main_process_port",
        str(port or free_port()),
        str(checkout_dir() / "src" / "train.py" if entry_point == "src/train.py" else PALU_TRAIN),
    ]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "configuration",
    # the other stack's suite runs two: the reference cache, tied, as users run PALU by default, and LoRA
    [
        pytest.param(name, marks=[pytest.mark.stack] if name in STACK_CONFIGURATIONS else [])
        for name in CONFIGURATIONS
    ],
)
def test_zero3_two_uneven_ranks(
    configuration, tmp_path, uneven_data, model_dirs, zero3_config, single_process
):
    overrides, tied = CONFIGURATIONS[configuration]
    port = free_port()
    launcher = zero3_launcher(zero3_config, port)
    lora = "LoRA" in configuration
    # LoRA: a checkpoint at the last step, with its optimizer state (resumable), as users save per epoch
    saving = (
        [
            "trainer.args.save_strategy=steps",
            f"+trainer.args.save_steps={STEPS}",
            "trainer.args.save_only_model=false",
        ]
        if lora
        else []
    )
    distributed = run(launcher, [*overrides, *saving], uneven_data, model_dirs[tied], tmp_path, processes=2)
    assert_same_run(configuration, distributed, single_process[configuration], model_dirs[tied])
    # DeepSpeed's CPU allreduce buffers (66 MB of RAM a rank) are gone with the run
    assert list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")) == []
    if lora:
        assert_checkpoint_is_the_final_model(
            tmp_path / f"checkpoint-{STEPS}", distributed[1], model_dirs[tied]
        )


def assert_checkpoint_is_the_final_model(checkpoint, final_weights, model_dir):
    """A ZeRO-3 LoRA checkpoint holds every adapter whole (gathered, not the ranks' shards), and loaded as a
    model path (the base its adapter_config.json names, the adapter merged: what palu-eval does with a
    per-epoch checkpoint) it is the run's final merged model."""
    from omegaconf import OmegaConf

    from palu_trainer.framework.checkout import ensure_importable
    from palu_trainer.framework.patches.adapters import merging_adapter_checkpoints

    ensure_importable()
    from model import get_model

    adapter = load_file(checkpoint / "adapter_model.safetensors")
    assert adapter and all(tensor.numel() > 0 for tensor in adapter.values()), checkpoint
    assert not (checkpoint / "model.safetensors").exists()
    assert list(checkpoint.glob("global_step*")), "no DeepSpeed optimizer state: the checkpoint cannot resume"
    model_cfg = OmegaConf.create(
        {"model_args": {"pretrained_model_name_or_path": str(checkpoint)}}
        | {"tokenizer_args": {"pretrained_model_name_or_path": str(model_dir)}}
    )
    loaded, _ = merging_adapter_checkpoints(get_model)(model_cfg)
    state = {name: tensor.float() for name, tensor in loaded.state_dict().items()}
    for name, tensor in final_weights.items():
        torch.testing.assert_close(state[name], tensor.float(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_ddp_two_uneven_ranks(tmp_path, uneven_data, model_dirs, single_process):
    configuration = DDP_CONFIGURATION
    overrides, tied = CONFIGURATIONS[configuration]
    launcher = [str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", str(PALU_TRAIN)]
    # finetune.yaml's `ddp_find_unused_parameters: None` is the string "None", which DDP rejects.
    overrides = [*overrides, "trainer.args.ddp_find_unused_parameters=false"]
    distributed = run(launcher, overrides, uneven_data, model_dirs[tied], tmp_path, processes=2)
    assert_same_run(configuration, distributed, single_process[configuration], model_dirs[tied])


RESUMED_STEPS = 6
RESUMED_OVERRIDES = [*CONFIGURATIONS["PALU-reference-cache-tied"][0], "trainer.args.save_only_model=false"]


def logged_steps(out_dir) -> dict[int, dict]:
    history = json.loads((out_dir / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry for entry in history if "loss" in entry}


@pytest.fixture(scope="module")
def uninterrupted_zero3_run(tmp_path_factory, uneven_data, model_dirs, zero3_config) -> dict[int, dict]:
    """The logged steps of a ZeRO-3 run never stopped, through palu-train: the losses of both entry points'
    resumed runs (the entry points train alike: test_framework_entry_point)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    launcher = zero3_launcher(zero3_config)
    command, env = launch(launcher, RESUMED_OVERRIDES, uneven_data, model_dirs[True], out, 2, RESUMED_STEPS)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=checkout_dir())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return logged_steps(out)


@pytest.mark.distributed
@pytest.mark.parametrize("entry_point", [pytest.param("palu-train", marks=pytest.mark.stack), "src/train.py"])
def test_a_sigtermed_zero3_run_resumes_with_the_uninterrupted_runs_losses(
    tmp_path, uneven_data, model_dirs, zero3_config, uninterrupted_zero3_run, entry_point
):
    """The documented path on a cluster: SIGTERM to the launcher writes a checkpoint and prints the command
    that resumes it; run under the launcher again, it finishes with the losses of a run never stopped (the
    reference cache comes back from the checkpoint: under ZeRO-3 it cannot be rebuilt before the
    checkpoint's weights load)."""
    overrides, model_dir = RESUMED_OVERRIDES, model_dirs[True]
    launcher = zero3_launcher(zero3_config, entry_point=entry_point)
    stopped = tmp_path / "stopped"
    command, env = launch(launcher, overrides, uneven_data, model_dir, stopped, 2, RESUMED_STEPS)
    code, output = preempted_after(
        3, command, signal.SIGTERM, {**env, "PYTHONUNBUFFERED": "1"}, cwd=checkout_dir()
    )
    assert code != 0, output[-3000:]
    step = int(re.search(r"stopped by SIGTERM after step (\d+) of", output).group(1))
    assert 3 <= step < RESUMED_STEPS, output[-3000:]
    # the ranks end in one line each; the only traceback is the launcher's own (accelerate's SignalException)
    assert output.count("Traceback") == output.count("got signal: 15") == 1, output[-6000:]
    resume = shlex.split(output.split("Resume with:\n")[1].splitlines()[0].split("   (under")[0])
    assert resume[-1] == f"+trainer.args.resume_from_checkpoint={stopped / f'checkpoint-{step}'}"
    arguments = resume[2:] if entry_point == "src/train.py" else resume[1:]
    resumed = subprocess.run(
        [*launcher, *arguments], env=env, capture_output=True, text=True, timeout=900, cwd=checkout_dir()
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert f"reference cache read from {stopped / f'checkpoint-{step}'}" in resumed.stdout + resumed.stderr
    uninterrupted, continued = uninterrupted_zero3_run, logged_steps(stopped)
    assert sorted(continued) == list(range(1, RESUMED_STEPS + 1))
    for key in LOGGED["PALU"]:
        for number in range(step + 1, RESUMED_STEPS + 1):
            assert continued[number][key] == pytest.approx(uninterrupted[number][key], rel=1e-4), (
                number,
                key,
            )


def rank_process(rank: int, port: int) -> int:
    """The pid of the launched process with RANK=`rank` on MASTER_PORT=`port`."""
    wanted = {f"RANK={rank}".encode(), f"MASTER_PORT={port}".encode()}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if wanted <= set(environ.read_bytes().split(b"\0")):
                return int(environ.parent.name)
        except OSError:
            continue
    raise AssertionError(f"no process with RANK={rank} on port {port}")


@pytest.mark.distributed
@pytest.mark.parametrize("entry_point", ["palu-train", "src/train.py"])
def test_a_killed_rank_ends_the_run_in_one_line_marked_failed_and_the_next_run_clears_its_litter(
    tmp_path, uneven_data, model_dirs, zero3_config, entry_point
):
    """SIGKILL to one rank of a ZeRO-3 run: the other stops within seconds in one line that says what
    happened and how to resume, the folder is marked failed and unlocked, the surviving rank's
    shared-memory buffer is released; the killed rank's, which nothing could release, goes with the next
    run's start."""
    port = free_port()
    out = tmp_path / "run"
    overrides = [*CONFIGURATIONS["PALU-reference-cache-tied"][0], "trainer.args.save_only_model=false"]
    launcher = zero3_launcher(zero3_config, port, entry_point)
    command, env = launch(launcher, overrides, uneven_data, model_dirs[True], out, 2, steps=60)
    process = subprocess.Popen(
        command,
        cwd=checkout_dir(),
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = ""
    while output.count("{'loss': ") < 2:
        line = process.stdout.readline()
        assert line, output[-3000:]
        output += line
    os.kill(rank_process(1, port), signal.SIGKILL)
    output += process.communicate(timeout=300)[0]
    assert process.returncode != 0
    program = "train.py" if entry_point == "src/train.py" else "palu-train"
    assert f"{program}: another process of this run stopped (" in output, output[-6000:]
    assert (out / FAILED_RUN_FILE).is_file() and not (out / LOCK_FILE).exists()
    buffers = sorted(
        path.name for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")
    )
    assert all(name.endswith(f"_{port}_1") for name in buffers), buffers  # rank 0's released
    if buffers:
        command, env = launch(
            [str(PALU_TRAIN)], overrides, uneven_data, model_dirs[True], tmp_path / "next", 1
        )
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        # any training run's start removes it (here this one's, unless another started first)
        assert not (Path("/dev/shm") / buffers[0]).exists()


EVALUATED_METRICS = ("forget_Q_A_Prob", "forget_Q_A_ROUGE")  # one of probabilities, one of generation
NOT_EVALUATING = ("trainer.args.do_eval", "trainer.args.eval_on_start", "trainer.args.eval_strategy", "~eval")


def evaluating(command: list[str]) -> list[str]:
    """`command` with the framework's TOFU evaluator (cut to EVALUATED_METRICS, answers of 16 tokens, its
    data from TOFU_DIR) run at the start and after every 2 steps."""
    others = ("forget_truth_ratio", "forget_quality", "model_utility", "privleak", "extraction_strength")
    return [
        *(arg for arg in command if not arg.startswith(NOT_EVALUATING)),
        "trainer.args.do_eval=true",
        "trainer.args.eval_on_start=true",
        "trainer.args.eval_strategy=steps",
        "+trainer.args.eval_steps=2",
        "eval.tofu.overwrite=true",
        "eval.tofu.metrics.forget_Q_A_ROUGE.generation_args.max_new_tokens=16",
        *(f"~eval.tofu.metrics.{metric}" for metric in others),
    ]


def evaluations(out_dir) -> dict[int, dict]:
    history = json.loads((out_dir / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry for entry in history if EVALUATED_METRICS[0] in entry}


@pytest.fixture(scope="module")
def evaluated_in_one_process(tmp_path_factory, uneven_data, tiny_model_dir) -> dict[int, dict]:
    """The evaluations of a 2-step run in one process (both rows in each step)."""
    out = tmp_path_factory.mktemp("evaluated-in-one-process")
    overrides = list(CONFIGURATIONS["PALU-reference-cache-tied"][0])
    command, env = launch([str(PALU_TRAIN)], overrides, uneven_data, tiny_model_dir, out, 1, 2)
    result = subprocess.run(evaluating(command), env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return evaluations(out)


@pytest.mark.distributed
@pytest.mark.parametrize("entry_point", ["palu-train", "src/train.py"])
def test_evaluation_during_training_under_zero3_gives_the_one_process_metrics(
    tmp_path, uneven_data, tiny_model_dir, zero3_config, evaluated_in_one_process, entry_point
):
    """The framework's evaluators at the start and after 2 steps of a ZeRO-3 run on 2 ranks (where the
    framework's own `evaluate` warns and returns nothing), offline: every rank evaluates, the main one
    writes checkpoint-<step>/evals, and the metrics equal a one-process run's at the same weights."""
    overrides = list(CONFIGURATIONS["PALU-reference-cache-tied"][0])
    launcher = zero3_launcher(zero3_config, entry_point=entry_point)
    command, env = launch(launcher, overrides, uneven_data, tiny_model_dir, tmp_path / "two", 2, 2)
    result = subprocess.run(
        evaluating(command), env=env, capture_output=True, text=True, timeout=900, cwd=checkout_dir()
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "Custom evaluator can be run with this Trainer only when a single" not in output
    one, two = evaluated_in_one_process, evaluations(tmp_path / "two")
    assert sorted(two) == sorted(one) == [0, 2]
    # the same weights (step 0) give the same metrics; after steps, ZeRO-3's rounding moves the weights by a
    # little (assert_same_run), which the probability follows closely and greedy generation may not
    for metric in EVALUATED_METRICS:
        assert two[0][metric] == pytest.approx(one[0][metric], rel=1e-6), metric
    for step in one:
        print(f"step {step}: 2 ranks {[two[step][m] for m in EVALUATED_METRICS]}, 1 process "
              f"{[one[step][m] for m in EVALUATED_METRICS]}")  # fmt: skip
        assert two[step][EVALUATED_METRICS[0]] == pytest.approx(one[step][EVALUATED_METRICS[0]], rel=1e-3)
        assert 0 <= two[step][EVALUATED_METRICS[1]] <= 1
        evals = tmp_path / "two" / f"checkpoint-{step}" / "evals"
        summary = json.loads((evals / "TOFU_SUMMARY.json").read_text())
        assert summary[EVALUATED_METRICS[0]] == pytest.approx(two[step][EVALUATED_METRICS[0]])


PARTIAL_WINDOWS = [
    *CONFIGURATIONS["PALU-reference-cache-tied"][0],
    "trainer.args.gradient_accumulation_steps=2",
    "trainer.args.num_train_epochs=2",
    "++trainer.args.max_steps=-1",
    "trainer.args.ddp_find_unused_parameters=false",
]


@pytest.mark.distributed
def test_an_epochs_partial_window_steps_alike_under_ddp_and_zero3(
    tmp_path, tofu_dir, shared_dir, model_dirs, zero3_config
):
    """6 forget rows on 2 ranks, 3 micro-batches each an epoch at accumulation 2: windows of 2 and 1, 4
    steps in 2 epochs (docs/method.md, "Gradient accumulation"). DDP syncs and steps where accelerate counts
    a window's end, ZeRO-3 where DeepSpeed does: both at the epoch's end too, so the runs agree (to
    `assert_same_run`'s tolerances). With accelerate's count running across epochs, as transformers 4.45
    sets it, DDP's optimizer skipped every step its count did not end (measured: no loss moved)."""
    forget = read_jsonl(tofu_dir / "forget01.json")[:6]
    retain = read_jsonl(tofu_dir / "retain99.json")[:1]
    replaced = {"forget01": forget, "retain99": retain, "holdout01": retain}
    mirror = make_tofu_mirror(tmp_path / "tofu", tofu_dir, replaced)
    _, spans = read_tpo(shared_dir / "data" / "tofu_spans_gpt4o" / "forget01.jsonl")
    annotations = tmp_path / "forget01.jsonl"
    write_annotations(annotations, [row["answer"] for row in forget], spans[:6])
    torchrun = [str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", str(PALU_TRAIN)]
    data, model_dir = (mirror, annotations), model_dirs[True]
    ddp = run(torchrun, PARTIAL_WINDOWS, data, model_dir, tmp_path / "ddp", processes=2)
    zero3 = run(
        zero3_launcher(zero3_config), PARTIAL_WINDOWS, data, model_dir, tmp_path / "zero3", processes=2
    )
    for steps, _ in (ddp, zero3):
        assert [entry["epoch"] for entry in steps] == pytest.approx([2 / 3, 1, 5 / 3, 2])
    initial = load_file(model_dir / "model.safetensors")
    for name, tensor in zero3[1].items():
        update, ddp_update = tensor - initial[name], ddp[1][name] - initial[name]
        assert float(ddp_update.norm()) > 0, name
        assert float((update - ddp_update).norm()) <= 0.1 * float(ddp_update.norm()), name
    for entry, ddp_entry in zip(zero3[0], ddp[0]):
        assert entry["loss"] == pytest.approx(ddp_entry["loss"], rel=1e-3)
