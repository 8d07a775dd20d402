"""vLLM against the built-in engine on this machine: generation throughput, weight-sync time, and a fit's step time.

    .venv-vllm/bin/python experiments/bench_vllm.py [--models embedded smollm2] [--repeats 3] [--server] [--fits]

Needs ``.venv-vllm`` (``./install_vllm.sh``). For each model (the embedded default, and SmolLM2-135M when
``experiments/smollm2.py`` has built it), in one process, timed alternately (median of ``--repeats``):

* **generation**: the same batch -- 16 prompts x n = 8, up to 16 new tokens, temperature 1, seeded -- through
  ``KVCacheEngine`` (bound to the policy, as in training) and ``VLLMEngine`` (and ``VLLMServerEngine`` with
  ``--server``); generated tokens per second (EOS included, padding not);
* **sync**: ``load_weights`` of the policy's full state dict into each vLLM engine (the colocated one's
  ``collective_rpc``; the server's safetensors write + ``/collective_rpc`` + ``/reset_prefix_cache``);
* with ``--fits``: ``rl-lightning fit --config configs/grpo.yaml`` for 10 steps (and ``configs/grpo_smollm2.yaml``
  for 4) with the built-in engine and with ``configs/presets/vllm.yaml``, and the median ``perf/step_time`` /
  ``perf/rollout_time`` of the steps after the first.

Prints one Markdown table per part. The machine is shared: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = Path("~/.cache/rl_lightning/SmolLM2-135M-Instruct").expanduser()
PROMPTS, N, NEW = 16, 8, 16


def model_path(name: str) -> str | None:
    if name == "embedded":
        return "embedded:arithmetic"
    return str(SMOLLM2) if SMOLLM2.is_dir() else None


def batch(name: str, tokenizer) -> list[list[int]]:  # noqa: ANN001
    """The benchmark's prompts as ids: additions in the embedded model's format, or a word problem for SmolLM2."""
    pairs = zip(range(10, 10 + PROMPTS), range(40, 40 + PROMPTS))
    texts = [f"{a}+{b}=" if name == "embedded" else f"What is {a} plus {b}? Answer with a number." for a, b in pairs]
    return [tokenizer(t)["input_ids"] for t in texts]


def timed(fn) -> tuple[float, object]:  # noqa: ANN001
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_model(name: str, repeats: int, server: bool) -> tuple[list[list[str]], list[list[str]]]:
    from rl_lightning.models.policy import load_policy
    from rl_lightning.rollout import KVCacheEngine, SamplingParams, VLLMEngine, VLLMServerEngine

    policy, tok = load_policy(model_path(name))
    prompts = batch(name, tok)
    params = SamplingParams(max_tokens=NEW, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0)
    engines = {"KVCacheEngine": KVCacheEngine().bound(policy), "VLLMEngine": VLLMEngine()}
    if server:
        engines["VLLMServerEngine"] = VLLMServerEngine()
    for key, engine in engines.items():
        if key != "KVCacheEngine":
            seconds, _ = timed(lambda: engine.setup(policy))
            print(f"[{name}] {key} setup {seconds:.1f} s", flush=True)
    rates: dict[str, list[float]] = {k: [] for k in engines}
    syncs: dict[str, list[float]] = {k: [] for k in engines if k != "KVCacheEngine"}
    try:
        for key, engine in engines.items():  # warm-up
            engine.generate(prompts, params, n=N)
        for r in range(repeats):
            for key, engine in engines.items():
                with torch.no_grad():
                    seconds, gen = timed(lambda: engine.generate(prompts, params, n=N))
                rates[key].append(float(gen.mask.sum()) / seconds)
                if key in syncs:
                    seconds, _ = timed(lambda: engine.load_weights(policy.state_dict(), version=r + 1))
                    syncs[key].append(seconds)
    finally:
        for key, engine in engines.items():
            if key != "KVCacheEngine":
                engine.close()
    params_m = sum(p.numel() for p in policy.parameters()) / 1e6
    gen_rows = [[name, f"{params_m:.1f}M", key, f"{statistics.median(v):,.0f}",
                 f"{statistics.median(v) / statistics.median(rates['KVCacheEngine']):.2f}"] for key, v in rates.items()]
    sync_rows = [[name, key, f"{statistics.median(v) * 1000:,.0f}"] for key, v in syncs.items()]
    return gen_rows, sync_rows


def fit_times(config: str, preset: str | None, steps: int) -> tuple[float, float]:
    """Median ``perf/step_time`` and ``perf/rollout_time`` of steps 1 .. steps-1 of ``rl-lightning fit --config
    config [--config preset]`` (``steps`` steps, one held-out evaluation at the end only)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as run:
        args = [sys.executable, "-m", "rl_lightning", "fit", "--config", str(REPO / config),
                "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
                "--trainer.logger.init_args.name", "bench"]
        if preset:
            args += ["--config", str(REPO / preset)]
        subprocess.run(args, cwd=run, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, capture_output=True)
        acc = EventAccumulator(str(Path(run) / "runs" / "bench" / "version_0"))
        acc.Reload()
        med = lambda tag: statistics.median(e.value for e in acc.Scalars(tag) if 1 <= e.step < steps)  # noqa: E731
        return med("perf/step_time"), med("perf/rollout_time")


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["embedded", "smollm2"], choices=["embedded", "smollm2"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--server", action="store_true", help="also time VLLMServerEngine (a server start per model)")
    p.add_argument("--fits", action="store_true", help="also 10-step fits of configs/grpo.yaml with each engine")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    gen_rows, sync_rows = [], []
    for name in args.models:
        if model_path(name) is None:
            print(f"[{name}] skipped: no checkpoint at {SMOLLM2} (python experiments/smollm2.py builds it)")
            continue
        g, s = bench_model(name, args.repeats, args.server)
        gen_rows += g
        sync_rows += s
    print(f"\n{os.uname().nodename}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    table(["model", "params", "engine", f"tokens/s ({PROMPTS}x{N} rows, <= {NEW} new)", "x KVCacheEngine"], gen_rows)
    table(["model", "engine", "load_weights (ms)"], sync_rows)
    if args.fits:
        rows = []
        fits = [("embedded", "configs/grpo.yaml", 10)]
        if "smollm2" in args.models and SMOLLM2.is_dir():
            fits.append(("smollm2", "configs/grpo_smollm2.yaml", 4))
        for name, config, steps in fits:
            for label, preset in (("KVCacheEngine", None), ("VLLMEngine", "configs/presets/vllm.yaml")):
                step, rollout = fit_times(config, preset, steps)
                rows.append([f"{name}, `{config}`", label, f"{step:.2f}", f"{rollout:.2f}"])
        table(["run", "engine", "perf/step_time (s, median after step 0)", "perf/rollout_time (s)"], rows)

if __name__ == "__main__":
    main()
