#!/usr/bin/env bash
# Installs palu-trainer and open-unlearning into one Python environment, and converts SmolLM2-135M-Instruct
# (scripts/smollm2.sh); safe to run again.
# Inputs (from the Makefile): PY, TORCH_VERSION, TORCH_INDEX, OPEN_UNLEARNING_URL,
# OPEN_UNLEARNING_COMMIT, OPEN_UNLEARNING_DIR, OPEN_UNLEARNING_CACHE.
set -euo pipefail

say() { printf '== setup [%3d s]: %s\n' "$SECONDS" "$*"; }  # seconds since this setup began
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# 1. torch first, so nothing below pulls another build (a bare `torch` would fetch CUDA wheels).
if "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  say "torch $TORCH_VERSION present"
else
  say "installing torch $TORCH_VERSION"
  pip_install "torch==$TORCH_VERSION" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
fi

# 2. open-unlearning at the stack's commit, in a cache dir outside this repo (or an existing checkout). A
#    commit that only a pull request holds is fetched from the remote's pull-request heads.
has_commit() { git -C "$OPEN_UNLEARNING_DIR" cat-file -e "$OPEN_UNLEARNING_COMMIT^{commit}" 2>/dev/null; }
fetch_commit() {
  has_commit || git -C "$OPEN_UNLEARNING_DIR" fetch -q origin || true
  has_commit || git -C "$OPEN_UNLEARNING_DIR" fetch -q origin '+refs/pull/*/head:refs/remotes/origin/pull/*' || true
  has_commit
}
if [ ! -e "$OPEN_UNLEARNING_DIR" ]; then
  say "cloning $OPEN_UNLEARNING_URL into $OPEN_UNLEARNING_DIR"
  mkdir -p "$(dirname "$OPEN_UNLEARNING_DIR")"
  git clone -q "$OPEN_UNLEARNING_URL" "$OPEN_UNLEARNING_DIR"
  if ! fetch_commit; then
    echo "error: $OPEN_UNLEARNING_URL holds no commit $OPEN_UNLEARNING_COMMIT; pass OPEN_UNLEARNING_URL=<a remote that has it>" >&2
    exit 1
  fi
  git -C "$OPEN_UNLEARNING_DIR" -c advice.detachedHead=false checkout -q "$OPEN_UNLEARNING_COMMIT"
elif [ ! -f "$OPEN_UNLEARNING_DIR/src/trainer/unlearn/base.py" ]; then
  echo "error: $OPEN_UNLEARNING_DIR exists but is not an open-unlearning checkout" >&2
  exit 1
elif [ "$(dirname "$(realpath "$OPEN_UNLEARNING_DIR")")" = "$(realpath -m "$OPEN_UNLEARNING_CACHE")" ] \
  && [ "$(git -C "$OPEN_UNLEARNING_DIR" rev-parse HEAD)" != "$OPEN_UNLEARNING_COMMIT" ] \
  && [ -z "$(git -C "$OPEN_UNLEARNING_DIR" status --porcelain --untracked-files=no)" ]; then
  # a checkout an earlier setup cloned, left at the commit the stack had then: moved to today's
  if fetch_commit; then
    say "moving $OPEN_UNLEARNING_DIR to $OPEN_UNLEARNING_COMMIT"
    git -C "$OPEN_UNLEARNING_DIR" -c advice.detachedHead=false checkout -q "$OPEN_UNLEARNING_COMMIT"
  fi
fi
head=$(git -C "$OPEN_UNLEARNING_DIR" rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$head" != "$OPEN_UNLEARNING_COMMIT" ]; then
  printf '\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n' >&2
  printf '!! WARNING: open-unlearning at %s is at commit %s,\n' "$OPEN_UNLEARNING_DIR" "$head" >&2
  printf '!! not %s. PALU is tested at d3d7cf9 (STACK=4.45), 4ad738a\n' "$OPEN_UNLEARNING_COMMIT" >&2
  printf '!! (STACK=4.51) and c3301d8 (STACK=5); its requirements.txt sets the transformers installed (docs/setup.md).\n' >&2
  printf '!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n\n' >&2
else
  say "open-unlearning $head at $OPEN_UNLEARNING_DIR"
fi
prefix=$("$PY" -c 'import sys; print(sys.prefix)')
mkdir -p "$prefix/etc/palu_trainer"
realpath "$OPEN_UNLEARNING_DIR" > "$prefix/etc/palu_trainer/open-unlearning-dir"

# 3. Its requirements (with our torch held), deepspeed built against that torch, lm-eval, the plugin.
torch_pin="torch==$("$PY" -W ignore -c 'import torch; print(torch.__version__)')"
stamp="$prefix/etc/palu_trainer/requirements.sha1"
digest=$(cat "$OPEN_UNLEARNING_DIR/requirements.txt" "$OPEN_UNLEARNING_DIR/setup.py" setup.cfg lab/pyproject.toml <(echo "$torch_pin") | sha1sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ]; then
  say "requirements unchanged since the last setup"
else
  skip='torch|deepspeed'
  # CUDA-only: bitsandbytes; flash-linear-attention (PR #191's Qwen3.5 kernels, triton)
  command -v nvidia-smi >/dev/null || skip="$skip|bitsandbytes|flash-linear-attention"
  # lm-eval: the framework imports it at module level; after its PR #175 its setup.py names it as an extra
  lm_eval=$(grep -ohE -m1 'lm-eval==[0-9.]+' "$OPEN_UNLEARNING_DIR/setup.py" || true)
  requirements=$(mktemp)
  grep -viE "^($skip)([=<> ]|$)" "$OPEN_UNLEARNING_DIR/requirements.txt" > "$requirements"
  say "installing open-unlearning's requirements (skipping: ${skip//|/, })"
  pip_install -r "$requirements" "$torch_pin"
  say "installing deepspeed (built against $torch_pin) and lm-eval, which the framework imports"
  pip_install --no-build-isolation "deepspeed==0.15.4" "$torch_pin"
  pip_install "${lm_eval:-lm-eval==0.4.8}" "$torch_pin"
  say "installing palu-trainer and, for contributors, its lab (lab/: the miniature and the experiments; editable)"
  # each editable install rewrites this clone's egg-info folders: setups that run at once (CI prepares its
  # three stacks together) take turns on a lock file (flock, from util-linux; without it, no lock)
  mkdir -p build
  {
    flock 9 2>/dev/null || true
    pip_install -e ".[dev]" "$torch_pin"
    pip_install --no-deps -e lab
  } 9> build/setup.lock
  rm -f "$requirements"
  echo "$digest" > "$stamp"
fi

# DeepSpeed's CPU shared-memory op, which every ZeRO-3 launch on the CPU loads: built here (about a minute) into
# the venv's TORCH_EXTENSIONS_DIR (Makefile), not inside the first distributed test's time.
if ! command -v nvidia-smi >/dev/null; then
  say "building the CPU shared-memory op of DeepSpeed into ${TORCH_EXTENSIONS_DIR:-the default torch extensions folder}"
  "$PY" -m palu_trainer.framework.launch
fi

# 4. SmolLM2-135M-Instruct, a real pretrained model offline (scripts/smollm2.sh, docs/real-model.md). Nothing
#    else depends on it: a failure warns, and the tests that load it then fail in CI and skip elsewhere.
if ! bash scripts/smollm2.sh; then
  printf '\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n' >&2
  printf '!! WARNING: SmolLM2-135M-Instruct is not set up (the message above says why).\n' >&2
  printf '!! Everything else is; the tests on the real model skip (fail under CI=1).\n' >&2
  printf '!! Retry with `make smollm2` (docs/real-model.md).\n' >&2
  printf '!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n\n' >&2
fi
if command -v nvidia-smi >/dev/null && ! "$PY" -c 'import flash_attn' 2>/dev/null; then
  say "flash-attn not installed: the GPU recipe uses sdpa (with a warning); \`make flash-attn\` builds it (long)"
fi
say "done: $("$PY" -c 'import palu_trainer, torch, transformers; print("palu-trainer", palu_trainer.__version__, "torch", torch.__version__, "transformers", transformers.__version__)')"
