"""`make gpu-check`: the GPU recipe's whole path in minutes, with no download.

A randomly initialised Llama at Llama-2's |V| = 32000 (a byte-level BPE trained on TOFU's text, padded with
unused tokens; untied output embeddings, as Llama-2-7B; 162M parameters: hidden 768, 12 layers) in bf16
goes through `palu-train` on the local TOFU copy (forget01 / retain99; the hub's holdout01 is not in the
local copy, so the first 40 retain99 rows stand in for it): PALU with the reference cache on and off, TPO
and NPO, a few optimizer steps each, with the framework's paged AdamW, then `palu-eval` (the stock TOFU
evaluation) on PALU's result. On two or more visible GPUs every run is the framework's accelerate + ZeRO-3
launch over all of them. FlashAttention-2 where flash-attn imports, else sdpa (with a warning).

Printed: the plan (every command) before anything runs, then steps/s and peak GPU memory per method; exit
status 1 if any run fails, has a non-finite loss or writes no evaluation, 2 if a requirement is missing.
Steps/s: `train_steps_per_second` of the run's trainer_state.json (every step: PALU's first step also builds
its reference cache) and, from `palu-train`'s own step times (PALU_RUN_STATS=1, training/run_stats.py),
steps 2..n alone. Peak GPU memory: `torch.cuda.max_memory_allocated` of the training process at its end
(the largest over ranks), written by the same hook.

LoRA (`+peft=lora`) on an 8B-shaped model: a random-init Llama of Llama-3.1-8B's shape (8.0B parameters,
|V| = 128256) in bf16 on one GPU capped at 40 GiB (`torch.cuda.set_per_process_memory_fraction`, the A100
40GB of open-unlearning issue #179), for PALU with the reference cache and NPO, whose reference is the same
model with its adapters disabled; each prints its peak GPU memory.

`--cpu` runs the same pipeline on CPU (`+runtime=cpu`: fp32, AdamW, sdpa) with a small body at the same
|V|, fewer steps and 20 rows of each model-utility evaluation set (the LoRA runs on that body too, uncapped);
it reports peak resident memory instead.
"""

import argparse
import json
import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from safetensors import safe_open

from palu_lab import logged_runs
from palu_lab.benchmarks.dataset_folders import read_jsonl, write_configs_readme, write_jsonl
from palu_lab.method_lists import GPU_CHECK_BASELINES
from palu_lab.tiny import save_tiny_model
from palu_trainer.benchmarks.hf_dir import read_configs
from palu_trainer.experiments.benchmark_facts import TOFU
from palu_trainer.experiments.requirements import flash_attention_problem
from palu_trainer.framework import launch
from palu_trainer.framework.checkout import PROJECT_ROOT, RESOURCES_DIR
from palu_trainer.training.run_stats import MEMORY_CAP_VARIABLE, RUN_STATS_VARIABLE

VOCAB_SIZE = 32000  # Llama-2's |V|
TRAINED_VOCAB = 8192  # merges learnt from TOFU's text; the rest of the 32000 are unused tokens
SPLITS = TOFU.splits["01"]
# What the runs and the stock TOFU evaluation load besides the holdout this check adds.
NEEDED_CONFIGS = (
    "full",
    "forget01",
    "retain99",
    "forget01_perturbed",
    "retain_perturbed",
    "real_authors_perturbed",
    "world_facts_perturbed",
)
PLACEHOLDER_HOLDOUT_ROWS = 40
EVAL_ONLY_CONFIGS = ("retain_perturbed", "real_authors_perturbed", "world_facts_perturbed")


@dataclass(frozen=True)
class CheckSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    steps: int
    max_new_tokens: int
    eval_batch_size: int
    eval_rows: int | None  # rows of each EVAL_ONLY_CONFIGS set; None: all
    num_kv_heads: int | None = None  # None: as many as query heads
    intermediate_size: int | None = None  # None: 4 x hidden
    vocab_size: int = VOCAB_SIZE


GPU_SIZE = CheckSize(
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    steps=30,
    max_new_tokens=64,
    eval_batch_size=64,
    eval_rows=None,
)
CPU_SIZE = CheckSize(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    steps=3,
    max_new_tokens=8,
    eval_batch_size=16,
    eval_rows=20,
)

# Llama-3.1-8B's shape (open-unlearning's 8B model config), the LoRA runs' model on a GPU
LORA_8B_SIZE = replace(
    GPU_SIZE,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    steps=5,
)
LORA_MEMORY_CAP_GIB = 40
# label -> (method of the side-by-side table, extra overrides)
RUNS = {
    "PALU cache on": ("PALU", ("trainer.method_args.reference_cache=true",)),
    "PALU cache off": ("PALU", ("trainer.method_args.reference_cache=false",)),
    **{name: (name, ()) for name in GPU_CHECK_BASELINES},
    "PALU LoRA 8B": ("PALU", ("+peft=lora", "trainer.method_args.reference_cache=true")),
    "NPO LoRA 8B": ("NPO", ("+peft=lora",)),
}
LORA_RUNS = ("PALU LoRA 8B", "NPO LoRA 8B")
EVALUATED = "PALU cache on"
EVAL_METRICS = ("model_utility", "forget_Q_A_ROUGE", "forget_Q_A_Prob", "forget_truth_ratio", "privleak")


def slug(label: str) -> str:
    return label.lower().replace(" ", "_")


def requirement_problems(tofu_dir: Path, cpu: bool, gpus: int) -> list[str]:
    """What this machine lacks for the check, each with what to do; empty when ready."""
    problems = []
    if not cpu and gpus == 0:
        problems.append(
            "no CUDA GPU visible: make gpu-check needs one (check nvidia-smi, CUDA_VISIBLE_DEVICES and that "
            "torch is a CUDA build). `make gpu-check CPU=1` runs the same pipeline on CPU (fp32, a small "
            "body, fewer steps)"
        )
    try:
        available = read_configs(tofu_dir)
    except FileNotFoundError as error:
        problems.append(f"TOFU: {error}; pass TOFU_DIR= (make) or --tofu-dir, a local copy of locuslab/TOFU")
    else:
        absent = [name for name in NEEDED_CONFIGS if name not in available]
        if absent:
            problems.append(f"TOFU: {tofu_dir} lacks the configs {', '.join(absent)}")
    spans = RESOURCES_DIR / "span_annotations" / "tofu_forget01.jsonl"
    if not spans.is_file():
        problems.append(f"{spans} not found: PALU and TPO read forget01's span annotations from it")
    tools = ["palu-train", "palu-eval"] + (["accelerate"] if gpus >= 2 and not cpu else [])
    problems.extend(
        f"{launch.BIN / tool} not found: run `make setup`"
        for tool in tools
        if not (launch.BIN / tool).is_file()
    )
    if not cpu and gpus > 0:
        try:
            import bitsandbytes  # noqa: F401  (the framework's paged_adamw_32bit)
        except Exception as error:
            problems.append(
                f"bitsandbytes does not import ({type(error).__name__}: {error}): the framework's optimizer "
                "paged_adamw_32bit needs it; `make setup` installs it where nvidia-smi exists"
            )
    return problems


def make_tofu_mirror(tofu_dir: Path, mirror: Path, eval_rows: int | None = None) -> Path:
    """A TOFU_DIR: the local files (linked) plus `holdout01`, which the stock evaluation loads and the local
    copy lacks: the first retain99 rows stand in (a random model has memorised nothing either way).
    `eval_rows`: keep only that many rows of the model-utility sets (`EVAL_ONLY_CONFIGS`: retain's 400, real
    authors' 100, world facts' 117 rows, each with perturbed answers: most of an evaluation's time on CPU)."""
    import yaml

    header = yaml.safe_load((tofu_dir / "README.md").read_text().split("---")[1])
    mirror.mkdir(parents=True)
    for source in sorted(tofu_dir.glob("*.json")):
        (mirror / source.name).symlink_to(source.resolve())
    holdout = read_jsonl(tofu_dir / "retain99.json")[:PLACEHOLDER_HOLDOUT_ROWS]
    write_jsonl(mirror / "holdout01.json", holdout, list(holdout[0]))
    for name in EVAL_ONLY_CONFIGS if eval_rows is not None else ():
        rows = read_jsonl(tofu_dir / f"{name}.json")[:eval_rows]
        (mirror / f"{name}.json").unlink()
        write_jsonl(mirror / f"{name}.json", rows, list(rows[0]))
    configs = [config for config in header["configs"] if config["config_name"] != "holdout01"]
    configs.append({"config_name": "holdout01", "data_files": "holdout01.json"})
    write_configs_readme(
        mirror, configs, f"{tofu_dir} plus a placeholder holdout01 (palu_trainer gpu_check)."
    )
    return mirror


def make_model(tofu_dir: Path, directory: Path, size: CheckSize, dtype=None, device=None) -> int:
    """Tokenizer (TOFU-trained BPE padded to the size's |V|) and a random-init Llama (weights in `dtype`,
    fp32 unless given, initialised on `device`); returns its parameters."""
    rows = read_jsonl(tofu_dir / "full.json")
    texts = [row["question"] + "\n" + row["answer"] for row in rows]
    save_tiny_model(
        directory,
        texts,
        vocab_size=TRAINED_VOCAB,
        padded_vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        num_layers=size.num_layers,
        num_heads=size.num_heads,
        tie_word_embeddings=False,
        num_kv_heads=size.num_kv_heads,
        intermediate_size=size.intermediate_size,
        dtype=dtype,
        device=device,
    )
    parameters = 0
    for shard in directory.glob("*.safetensors"):  # an 8B model is saved in shards
        with safe_open(shard, "pt") as weights:
            parameters += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    return parameters


def model_overrides(model_dir: Path) -> list[str]:
    return [
        "model=tiny-llama",
        *(
            f"model.{args}.pretrained_model_name_or_path={model_dir}"
            for args in ("model_args", "tokenizer_args")
        ),
    ]


def precision_overrides(cpu: bool, attention: str) -> list[str]:
    if cpu:
        return ["+runtime=cpu"]
    return ["model.model_args.torch_dtype=bfloat16", f"model.model_args.attn_implementation={attention}"]


def train_command(
    label: str, model_dir: Path, out: Path, size: CheckSize, cpu: bool, attention: str, launcher: list[str]
) -> list[str]:
    method, extra = RUNS[label]
    forget, retain, holdout = SPLITS
    return [
        *launcher,
        "--config-name=unlearn.yaml",
        *TOFU.method_overrides(method),
        *model_overrides(model_dir),
        f"forget_split={forget}",
        f"retain_split={retain}",
        f"holdout_split={holdout}",
        f"task_name=gpu_check_{slug(label)}",
        f"paths.output_dir={out / 'runs' / slug(label)}",
        f"+trainer.args.max_steps={size.steps}",
        "trainer.args.per_device_train_batch_size=4",
        "trainer.args.gradient_accumulation_steps=1",
        "trainer.args.gradient_checkpointing=true",
        *([] if cpu else ["trainer.args.bf16=true"]),
        "trainer.args.logging_steps=1",
        "trainer.args.do_eval=false",
        "trainer.args.eval_on_start=false",
        "trainer.args.eval_strategy=no",
        "trainer.args.report_to=none",
        *precision_overrides(cpu, attention),
        *extra,
    ]


def eval_command(out: Path, size: CheckSize, cpu: bool, attention: str) -> list[str]:
    forget, _, holdout = SPLITS
    return [
        *launch.command("palu-eval"),
        "experiment=eval/tofu/tiny",
        *model_overrides(out / "runs" / slug(EVALUATED)),
        f"forget_split={forget}",
        f"holdout_split={holdout}",
        f"max_new_tokens={size.max_new_tokens}",
        f"eval.tofu.batch_size={size.eval_batch_size}",
        "task_name=gpu_check_eval",
        f"paths.output_dir={out / 'eval'}",
        *precision_overrides(cpu, attention),
    ]


def offline_environment(tofu_mirror: Path, out: Path, omp_threads: str) -> dict:
    """The environment of palu-train and palu-eval runs on local files: TOFU from `tofu_mirror`, a datasets
    cache in `out`, step times and peak memory recorded (run_stats), OMP_NUM_THREADS unless set."""
    return {
        "OMP_NUM_THREADS": omp_threads,
        **os.environ,
        "TOFU_DIR": str(tofu_mirror),
        RUN_STATS_VARIABLE: "1",
        # nothing may come from the hub: the model, tokenizer and data are all local
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "datasets-cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def read_run_stats(output_dir: Path) -> list[dict]:
    """Every rank's stats of the run in `output_dir` (palu_trainer.training.run_stats), rank 0 first; empty if
    it wrote none."""
    files = sorted(Path(output_dir).glob("run_stats_rank*.json"), key=lambda p: int(p.stem.split("rank")[1]))
    return [json.loads(path.read_text()) for path in files]


def training_result(label: str, run_dir: Path, steps: int) -> dict:
    """Steps/s, peak memory and the losses of one finished run; `error` names what is wrong, if anything."""
    state_file = run_dir / "trainer_state.json"
    if not state_file.is_file():
        return {"error": f"no {state_file}"}
    history = json.loads(state_file.read_text())["log_history"]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    summary = next((entry for entry in history if "train_steps_per_second" in entry), {})
    stats = read_run_stats(run_dir)
    result = {
        "steps": summary.get("step", len(losses)),
        "steps_per_second": summary.get("train_steps_per_second"),
        "train_runtime_s": summary.get("train_runtime"),
        "losses": losses,
    }
    if stats:
        ends = stats[0]["step_end_seconds"]
        if len(ends) >= 2:
            result["steps_per_second_after_first"] = (len(ends) - 1) / (ends[-1] - ends[0])
        gpu_peaks = [
            rank["peak_gpu_memory_bytes"] for rank in stats if rank["peak_gpu_memory_bytes"] is not None
        ]
        result["peak_gpu_memory_bytes"] = max(gpu_peaks) if gpu_peaks else None
        result["peak_rss_bytes"] = max(rank["peak_rss_bytes"] for rank in stats)
        result["ranks"] = len(stats)
    if len(losses) != steps:
        result["error"] = f"{len(losses)} logged losses, {steps} steps asked for"
    elif not all(math.isfinite(loss) for loss in losses):
        result["error"] = f"non-finite loss: {losses}"
    elif not stats:
        result["error"] = f"no run_stats_rank*.json in {run_dir} ({RUN_STATS_VARIABLE} hook)"
    return result


def format_table(results: dict[str, dict], cpu: bool) -> str:
    memory = "peak RSS" if cpu else "peak GPU memory"
    header = (
        f"{'method':<16} {'steps':>5} {'steps/s':>8} {'steps/s 2..n':>13} {memory:>16} {'wall':>7}  status"
    )
    lines = [header, "-" * len(header)]
    for label, result in results.items():
        peak = result.get("peak_rss_bytes" if cpu else "peak_gpu_memory_bytes")

        def number(key, form, result=result):
            value = result.get(key)
            return format(value, form) if isinstance(value, (int, float)) else "-"

        lines.append(
            f"{label:<16} {number('steps', 'd'):>5} {number('steps_per_second', '.2f'):>8} "
            f"{number('steps_per_second_after_first', '.2f'):>13} "
            f"{(f'{peak / 2**30:.2f} GiB' if peak else '-'):>16} {number('wall_s', '.0f') + ' s':>7}  "
            f"{'FAILED: ' + result['error'] if result.get('error') else 'ok'}"
        )
    return "\n".join(lines)


def one_gpu(env: dict) -> dict:
    """The first visible GPU alone."""
    return {"CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu", action="store_true", help="the same pipeline on CPU: fp32, small body, 3 steps"
    )
    parser.add_argument("--steps", type=int, help=f"optimizer steps per run (GPU {GPU_SIZE.steps}, CPU 3)")
    parser.add_argument(
        "--tofu-dir",
        type=Path,
        default=Path(os.environ.get("TOFU_DIR") or PROJECT_ROOT.parent / "shared" / "data" / "tofu"),
        help="a local copy of locuslab/TOFU (default: TOFU_DIR, else ../shared/data/tofu)",
    )
    parser.add_argument("--out", type=Path, default=Path("results/gpu_check"), help="working folder")
    parser.add_argument("--methods", nargs="+", choices=list(RUNS), default=list(RUNS), metavar="RUN")
    args = parser.parse_args(argv)
    import torch

    size = CPU_SIZE if args.cpu else GPU_SIZE
    if args.steps:
        size = CheckSize(**{**size.__dict__, "steps": args.steps})
    gpus = 0 if args.cpu else torch.cuda.device_count()
    problems = requirement_problems(args.tofu_dir, args.cpu, gpus)
    if EVALUATED not in args.methods:
        problems.append(f"--methods must include {EVALUATED!r}: palu-eval evaluates its result")
    if problems:
        print("gpu-check cannot run here:", *(f"  - {p}" for p in problems), sep="\n", file=sys.stderr)
        sys.exit(2)
    attention = "sdpa"
    if not args.cpu:
        reason = flash_attention_problem()
        if reason is None:
            attention = "flash_attention_2"
        else:
            print(
                f"warning: {reason}: the runs use attn_implementation=sdpa, not the framework configs' "
                "flash_attention_2; `make flash-attn` installs it",
                file=sys.stderr,
            )
    out = args.out.resolve()
    for part in ("model", "tofu", "runs", "eval", "logs", "accelerate", "datasets-cache"):
        shutil.rmtree(out / part, ignore_errors=True)
    config = launch.write_accelerate_config(out / "accelerate", gpus, bf16=True) if gpus >= 2 else None
    launcher = launch.command("palu-train", config)
    device = "CPU (+runtime=cpu, fp32)" if args.cpu else f"{gpus} x {torch.cuda.get_device_name(0)} (bf16)"
    # LoRA's case: one process, on the 8B-shaped model on a GPU (the small body on CPU)
    lora_size = size if args.cpu else LORA_8B_SIZE
    lora_model = out / ("model" if args.cpu else "model-8b")
    steps = {label: lora_size.steps if label in LORA_RUNS else size.steps for label in args.methods}
    train = {
        label: train_command(label, out / "model", out, size, args.cpu, attention, launcher)
        if label not in LORA_RUNS
        else train_command(
            label, lora_model, out, lora_size, args.cpu, attention, launch.command("palu-train")
        )
        for label in args.methods
    }
    evaluation = eval_command(out, size, args.cpu, attention)
    distribution = "ZeRO-3 over every GPU (accelerate)" if gpus >= 2 else "one process"
    retain_note = f"; model-utility sets: {size.eval_rows} rows each" if size.eval_rows else ""
    print(
        f"gpu-check plan: random-init Llama, |V|={VOCAB_SIZE}, hidden {size.hidden_size} x {size.num_layers} "
        f"layers, untied; {device}, {attention}, {distribution}; {size.steps} steps per run, batch 4 per "
        f"device; TOFU {args.tofu_dir} ({', '.join(SPLITS)}; holdout01 = {PLACEHOLDER_HOLDOUT_ROWS} retain99 "
        f"rows{retain_note}); work folder {out}"
    )
    if set(LORA_RUNS) & set(train) and not args.cpu:
        print(
            f"LoRA runs: Llama-3.1-8B's shape (hidden {lora_size.hidden_size} x {lora_size.num_layers} "
            f"layers, {lora_size.num_kv_heads} key-value heads, MLP {lora_size.intermediate_size}, "
            f"|V|={lora_size.vocab_size}) in bf16, one GPU capped at {LORA_MEMORY_CAP_GIB} GiB, "
            f"{lora_size.steps} steps"
        )
    for label, command in train.items():
        print(f"# {label}\n{shlex.join(command)}")
    print(f"# palu-eval on {EVALUATED}\n{shlex.join(evaluation)}", flush=True)

    started = time.monotonic()
    parameters = make_model(args.tofu_dir, out / "model", size)
    if set(LORA_RUNS) & set(train) and not args.cpu:
        lora_parameters = make_model(args.tofu_dir, lora_model, lora_size, torch.bfloat16, device="cuda")
        print(f"LoRA model: {lora_parameters / 1e9:.2f}B parameters ({time.monotonic() - started:.0f} s)")
    mirror = make_tofu_mirror(args.tofu_dir, out / "tofu", size.eval_rows)
    print(
        f"model: {parameters / 1e6:.1f}M parameters; model, tokenizer, TOFU mirror: "
        f"{time.monotonic() - started:.0f} s"
    )
    env = offline_environment(mirror, out, "1" if args.cpu else os.environ.get("OMP_NUM_THREADS", "4"))
    lora_env = env if args.cpu else {**env, **one_gpu(env), MEMORY_CAP_VARIABLE: str(LORA_MEMORY_CAP_GIB)}
    results = {}
    for label, command in train.items():
        print(f"== {label} …", flush=True)
        log = out / "logs" / f"{slug(label)}.log"
        code, seconds = logged_runs.run_logged(command, log, lora_env if label in LORA_RUNS else env)
        result = (
            {"error": f"exit status {code}"}
            if code
            else training_result(label, out / "runs" / slug(label), steps[label])
        )
        result["wall_s"] = seconds
        results[label] = result
        if result.get("error"):
            print(f"   FAILED ({result['error']}); {log}:\n{logged_runs.log_tail(log)}", flush=True)

    print(f"== palu-eval on {EVALUATED} …", flush=True)
    eval_env = env if args.cpu else {**env, **one_gpu(env)}
    log = out / "logs" / "eval.log"
    if results[EVALUATED].get("error"):
        eval_result = {"error": f"{EVALUATED} failed: nothing to evaluate"}
    else:
        code, seconds = logged_runs.run_logged(evaluation, log, eval_env)
        eval_file = out / "eval" / "TOFU_EVAL.json"
        if code:
            eval_result = {"error": f"exit status {code}"}
        elif not eval_file.is_file():
            eval_result = {"error": f"no {eval_file}"}
        else:
            logs = json.loads(eval_file.read_text())
            values = {name: logs[name].get("agg_value") for name in EVAL_METRICS if name in logs}
            eval_result = {"metrics": values, "wall_s": seconds}
            absent = [name for name in EVAL_METRICS if values.get(name) is None and name != "privleak"]
            if absent:
                eval_result["error"] = f"no value for {', '.join(absent)}"
        if eval_result.get("error"):
            print(f"   FAILED ({eval_result['error']}); {log}:\n{logged_runs.log_tail(log)}", flush=True)

    print(f"\ngpu-check: {device}, {attention}, {parameters / 1e6:.1f}M parameters, |V|={VOCAB_SIZE}")
    print(format_table(results, args.cpu))
    if "metrics" in eval_result:
        shown = ", ".join(
            f"{name} {value:.4g}" for name, value in eval_result["metrics"].items() if value is not None
        )
        print(f"palu-eval ({EVALUATED}): {eval_result['wall_s']:.0f} s; {shown}")
    failures = [label for label, result in results.items() if result.get("error")]
    failures += ["palu-eval"] if eval_result.get("error") else []
    summary = {"device": device, "attention": attention, "parameters": parameters, "vocab_size": VOCAB_SIZE,
               "steps": size.steps, "runs": results, "eval": eval_result, "failures": failures}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    total = time.monotonic() - started
    if failures:
        print(f"gpu-check FAILED ({', '.join(failures)}) in {total:.0f} s; logs in {out / 'logs'}")
        sys.exit(1)
    print(f"gpu-check passed: {len(results)} runs and palu-eval in {total:.0f} s")


if __name__ == "__main__":
    main()
