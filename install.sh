#!/usr/bin/env bash
# Install rl_lightning into ./.venv (idempotent; a second run only checks), with the test tools and the
# optional environment suites the tests cover (gem-llm, reasoning-gym; pycosat compiles with the C compiler) and
# peft (LoRA adapters), datasets (DatasetTask) and math-verify (MathVerifyReward).
# On a machine without an NVIDIA GPU, the CPU build of `torch==2.13.0` is installed first, so that
# resolving the package's dependencies never pulls a multi-GB CUDA build: a local wheel when pip's
# find-links hold one (this project's machines), else from PyTorch's CPU index (PyPI's Linux wheel of the
# same version depends on the CUDA libraries; `2.13.0+cpu` is preferred over it as the later version).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" "torch>=2.4,<=2.14.1"
  elif "${PIP[@]}" --no-index --no-deps --dry-run "torch==2.13.0" 2>/dev/null; then
    "${PIP[@]}" "torch==2.13.0"
  else
    "${PIP[@]}" --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
  fi
fi
"${PIP[@]}" -e ".[dev,gem,reasoning-gym,lora,data,math]"
# gem-llm pins reasoning-gym==0.1.23 and nltk, which its games do not need: installed without its dependencies
# (docs/environments.md); the `gem` extra above brings what it does need
"${PIP[@]}" --no-deps "gem-llm==0.1.0"
.venv/bin/python -c "import rl_lightning, torch; print(f'rl_lightning {rl_lightning.__version__} installed (torch {torch.__version__})')"
