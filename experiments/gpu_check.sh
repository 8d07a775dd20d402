#!/usr/bin/env bash
# Everything only a GPU can show, in one script of at most ~10 minutes on one GPU (issue 14, item 7).
#
#   experiments/gpu_check.sh [OUT_DIR]        (default: experiments/out/gpu_check; on the device tool: $OUT)
#
# It writes OUT_DIR/gpu_check.txt (every figure, in order) and the logs of each part next to it:
#   1. the gpu-marked tests (tests/test_gpu.py: fp32 on-policy log-probs on CUDA, bf16 weights train);
#   2. the default config in bf16 on one GPU (configs/grpo.yaml + configs/presets/gpu-bf16.yaml, 30 steps),
#      with its val/reward, step time and train/sampler_logp_diff;
#   3. two steps under the FSDP2 preset (ModelParallelStrategy) on one GPU (tested on 2 CPU processes only);
#   4. experiments/bench_vs_trl.py --device cuda at 50.6M parameters (needs `pip install -e '.[bench]'`);
#   5. configs/grpo_smollm2.yaml for 5 steps in bf16, if the SmolLM2-135M checkpoint was built
#      (experiments/smollm2.py);
#   6. vLLM on CUDA: ./install_vllm.sh (the `vllm` wheel where nvidia-smi works), the vllm-marked tests, and the
#      default config for 10 steps in bf16 through the colocated engine (configs/presets/vllm.yaml), with its
#      train/sampler_logp_diff (bf16 sampler) and step time.
# Each part has its own time limit; a part that fails is recorded as failed and the script goes on.
# Environment: PYTHON (the interpreter; default .venv/bin/python, else python3: a GPU image with torch installed
# and the repository on PYTHONPATH works, with `python -m rl_lightning.cli` for `rl-lightning`); GPU_CHECK_RUNS
# (where the runs' folders go; default OUT_DIR/runs). vLLM is skipped where neither .venv-vllm nor a package index is.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-experiments/out/gpu_check}}"
mkdir -p "$out"
report="$out/gpu_check.txt"
# The interpreter: $PYTHON if set, else .venv's, else python3 on the PATH (a GPU image with torch preinstalled,
# rl_lightning on PYTHONPATH or installed). `rl-lightning` falls back to `python -m rl_lightning.cli`.
py="${PYTHON:-.venv/bin/python}"
[ -x "$py" ] || py="$(command -v python3 || command -v python)"
bin="$(dirname "$py")"
if [ -x "$bin/rl-lightning" ]; then rl=("$bin/rl-lightning"); else rl=("$py" -m rl_lightning.cli); fi
: > "$report"
say() { echo "$*" | tee -a "$report"; }

part() {  # part NAME SECONDS COMMAND...: run with a time limit, keep its log, record rc and wall time
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  say "== $name: rc=$rc ($((SECONDS - start)) s; log $out/$name.log)"
  return $rc
}

say "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
"$py" - >> "$report" 2>&1 <<'PY'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count())
versions = []
for name in ("lightning", "transformers", "tokenizers", "jsonargparse", "peft", "trl", "vllm"):
    try:
        versions.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        versions.append(f"{name} -")
print(", ".join(versions))
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, bf16 supported: {torch.cuda.is_bf16_supported()}")
PY
cat "$report"

part gpu_tests 150 "$py" -m pytest tests/test_gpu.py -m gpu -q -s
grep -E "passed|failed|sampler_logp_diff" "$out/gpu_tests.log" | tee -a "$report"

runs="${GPU_CHECK_RUNS:-$out/runs}"  # the runs' folders (set it outside OUT_DIR to bring back only the logs)
part bf16_default 180 "${rl[@]}" fit --config configs/grpo.yaml --config configs/presets/gpu-bf16.yaml \
  --trainer.max_steps 30 --trainer.val_check_interval 10 --trainer.logger.init_args.save_dir "$runs" \
  --trainer.logger.init_args.name bf16_default
grep -E "^rl-lightning: " "$out/bf16_default.log" | tee -a "$report"
"$py" - "$runs/bf16_default" >> "$report" 2>&1 <<'PY'
import glob, statistics, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
for run in sorted(glob.glob(f"{sys.argv[1]}/version_*")):
    acc = EventAccumulator(run); acc.Reload()
    for tag in ("val/reward", "train/sampler_logp_diff", "perf/step_time", "perf/rollout_time", "perf/update_time"):
        values = [e.value for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []
        if values:
            print(f"  {tag}: first {values[0]:.4g}, last {values[-1]:.4g}, median {statistics.median(values):.4g}")
PY

part fsdp_two_steps 120 "${rl[@]}" fit --config configs/grpo.yaml --config configs/presets/fsdp.yaml \
  --trainer.devices 1 --trainer.strategy.init_args.data_parallel_size 1 --trainer.max_steps 2 --trainer.val_check_interval 2 \
  --trainer.logger.init_args.save_dir "$runs" --trainer.logger.init_args.name fsdp
grep -E "^rl-lightning: |Error" "$out/fsdp_two_steps.log" | tail -3 | tee -a "$report"

if "$py" -c "import trl" 2>/dev/null; then
  part bench_vs_trl 240 "$py" experiments/bench_vs_trl.py --device cuda --sizes 50.6M --steps 6 --repeats 2
  tail -25 "$out/bench_vs_trl.log" | tee -a "$report"
else
  say "== bench_vs_trl: skipped (trl not installed: pip install -e '.[bench]')"
fi

smol="$HOME/.cache/rl_lightning/SmolLM2-135M-Instruct"
if [ -d "$smol" ]; then
  part smollm2_bf16 240 "${rl[@]}" fit --config configs/grpo_smollm2.yaml --config configs/presets/gpu-bf16.yaml \
    --trainer.max_steps 5 --trainer.val_check_interval 5 --trainer.logger.init_args.save_dir "$runs" \
    --trainer.logger.init_args.name smollm2
  grep -E "^rl-lightning: " "$out/smollm2_bf16.log" | tee -a "$report"
else
  say "== smollm2_bf16: skipped (no checkpoint at $smol; build it with experiments/smollm2.py)"
fi
# vLLM: .venv-vllm as built, else ./install_vllm.sh where a package index answers (a GPU machine without one skips).
if ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null \
   && ! timeout 30 "$py" -m pip download --no-deps --retries 0 --timeout 10 -q -d /tmp/gpu_check_probe wheel 2>/dev/null; then
  say "== vllm: skipped (no .venv-vllm with vllm and no package index to install it from)"
elif part install_vllm 300 ./install_vllm.sh; then
  part vllm_tests 300 .venv-vllm/bin/python -m pytest -q -m vllm tests/vllm/test_vllm_engine.py -x
  grep -E "passed|failed" "$out/vllm_tests.log" | tail -2 | tee -a "$report"
  part vllm_bf16 240 .venv-vllm/bin/rl-lightning fit --config configs/grpo.yaml --config configs/presets/gpu-bf16.yaml \
    --config configs/presets/vllm.yaml --trainer.max_steps 10 --trainer.val_check_interval 10 \
    --trainer.logger.init_args.save_dir "$runs" --trainer.logger.init_args.name vllm_bf16
  grep -E "^rl-lightning: " "$out/vllm_bf16.log" | tee -a "$report"
  "$py" - "$runs/vllm_bf16" >> "$report" 2>&1 <<'PY'
import glob, statistics, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
for run in sorted(glob.glob(f"{sys.argv[1]}/version_*")):
    acc = EventAccumulator(run); acc.Reload()
    for tag in ("train/sampler_logp_diff", "perf/step_time", "perf/rollout_time"):
        values = [e.value for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []
        if values:
            print(f"  vllm {tag}: first {values[0]:.4g}, last {values[-1]:.4g}, median {statistics.median(values):.4g}")
PY
fi
say "# done: $report"
