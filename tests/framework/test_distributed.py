"""Two processes on CPU: DeepSpeed ZeRO-3 (the framework's config, via accelerate) and plain DDP (torchrun).

The data make the first step's rows the same in every run: a 2-row forget set (one row per process,
or both in one process with gradient accumulation 2) and a 1-row retain set.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from palu_trainer.framework.plugin import write_accelerate_config
from palu_trainer.spans.format import write_annotations
from palu_trainer.spans.tpo import read_tpo

from ..conftest import make_tofu_mirror, read_jsonl
from .test_integration import PALU_TRAIN, QUICK_RUN

BIN = Path(sys.executable).parent
FORGET_ROWS = 2


@pytest.fixture(scope="module")
def two_row_data(tmp_path_factory, tofu_dir, shared_dir):
    root = tmp_path_factory.mktemp("distributed")
    forget = read_jsonl(tofu_dir / "forget01.json")[:FORGET_ROWS]
    retain = read_jsonl(tofu_dir / "retain99.json")[:1]
    mirror = make_tofu_mirror(
        root / "tofu", tofu_dir, {"forget01": forget, "retain99": retain, "holdout01": retain}
    )
    _, spans = read_tpo(shared_dir / "data" / "tofu_spans_gpt4o" / "forget01.jsonl")
    annotations = root / "forget01.jsonl"
    write_annotations(annotations, [row["answer"] for row in forget], spans[:FORGET_ROWS])
    return mirror, annotations


@pytest.fixture(scope="module")
def zero3_config(tmp_path_factory):
    return write_accelerate_config(tmp_path_factory.mktemp("zero3"), num_processes=2, bf16="auto")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(launcher, overrides, data, model_dir, out_dir, processes):
    mirror, annotations = data
    command = [
        *launcher,
        *QUICK_RUN,
        "experiment=unlearn/tofu/palu",
        f"span_annotations={annotations}",
        "task_name=distributed",
        f"paths.output_dir={out_dir}",
        "++trainer.args.max_steps=2",
        "trainer.args.per_device_train_batch_size=1",
        f"trainer.args.gradient_accumulation_steps={FORGET_ROWS // processes}",
        "trainer.method_args.top_k=64",
        *[
            f"model.{args}.pretrained_model_name_or_path={model_dir}"
            for args in ("model_args", "tokenizer_args")
        ],
        *overrides,
    ]
    env = {**os.environ, "TOFU_DIR": str(mirror), "LOCAL_SIZE": str(processes), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    history = json.loads((out_dir / "trainer_state.json").read_text())["log_history"]
    return [entry for entry in history if "local_loss" in entry], load_file(out_dir / "model.safetensors")


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, two_row_data, tiny_model_dir):
    """Reference runs: one process, both rows in the first step through gradient accumulation."""
    out = tmp_path_factory.mktemp("single")
    return {
        cache: run(
            [str(PALU_TRAIN)],
            [f"trainer.method_args.reference_cache={cache}"],
            two_row_data,
            tiny_model_dir,
            out / str(cache),
            1,
        )
        for cache in (True, False)
    }


def assert_same_run(distributed, single, tiny_model_dir):
    (steps, weights), (single_steps, single_weights) = distributed, single
    assert len(steps) == 2
    for key in ("loss", "local_loss", "retain_loss", "grad_norm"):
        print(f"first step {key}: 2 processes {steps[0][key]}, 1 process {single_steps[0][key]}")
    assert steps[0]["grad_norm"] == pytest.approx(single_steps[0]["grad_norm"], rel=1e-4)
    for key in ("loss", "local_loss", "retain_loss"):
        assert steps[0][key] == pytest.approx(single_steps[0][key], abs=1e-4), key
    assert steps[0]["n_initiating"] == single_steps[0]["n_initiating"] > 0
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert weights.keys() == initial.keys()
    for name, tensor in weights.items():
        assert tensor.shape == initial[name].shape, name  # gathered, not a ZeRO-3 shard
        torch.testing.assert_close(tensor, single_weights[name], atol=2e-4, rtol=0, msg=name)
    assert sum(not weights[name].equal(initial[name]) for name in weights) > 10


@pytest.mark.parametrize("cache", [True, False], ids=["reference-cache", "sharded-reference"])
def test_zero3_two_processes(cache, tmp_path, two_row_data, tiny_model_dir, zero3_config, single_process):
    launcher = [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(zero3_config),
        "--main_process_port",
        str(free_port()),
        str(PALU_TRAIN),
    ]
    distributed = run(
        launcher, [f"trainer.method_args.reference_cache={cache}"], two_row_data, tiny_model_dir, tmp_path, 2
    )
    assert_same_run(distributed, single_process[cache], tiny_model_dir)


def test_ddp_two_processes(tmp_path, two_row_data, tiny_model_dir, single_process):
    launcher = [str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", str(PALU_TRAIN)]
    # finetune.yaml's `ddp_find_unused_parameters: None` is the string "None", which DDP rejects.
    overrides = ["+trainer.args.ddp_backend=gloo", "trainer.args.ddp_find_unused_parameters=false"]
    distributed = run(launcher, overrides, two_row_data, tiny_model_dir, tmp_path, 2)
    assert_same_run(distributed, single_process[True], tiny_model_dir)
