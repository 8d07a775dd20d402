"""AdamW's step on a real model's parameters: PyTorch's three implementations on the CPU.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_optimizer.py [--model DIR] [--steps 5] [--repeats 3]

``torch.optim.AdamW`` runs a Python loop over the parameters on a CPU unless told otherwise (``foreach`` is the
default only for CUDA tensors); ``foreach=True`` batches the element-wise operations over all parameters, and
``fused=True`` does the whole update in one kernel per parameter group. Hugging Face's ``Trainer`` (and so TRL's
``GRPOTrainer``) uses the fused one by default from torch 2.8 (``optim="adamw_torch_fused"``).

Every parameter of the local checkpoint ``--model`` (default: SmolLM2-135M-Instruct, built by
``experiments/smollm2.py``; nothing is downloaded) gets a gradient drawn once from a fixed seed; each implementation
takes ``--steps`` steps from the same start, ``--repeats`` times in alternation, and the median step time is
printed, with each implementation's largest parameter difference from the Python loop's after the same steps (the
same formula in another order of rounding: a few fp32 ulps).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as common

IMPLEMENTATIONS = {"python loop (CPU default)": {"foreach": False}, "foreach": {"foreach": True},
                   "fused": {"fused": True}}


def run(weights: list, grads: list, options: dict, steps: int) -> tuple[list[float], list]:
    """``steps`` AdamW steps (lr 1e-6, no weight decay, as the SmolLM2 config) from copies of ``weights``: the step
    times and the final parameters."""
    import torch

    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, **options)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return times, [p.detach() for p in params]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_option(p)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs per implementation")
    args = p.parse_args()
    ckpt = common.checkpoint_dir(args.model)

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    weights = [w.detach() for w in model.parameters()]
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(w.shape, generator=generator) * 1e-3 for w in weights]
    count = sum(w.numel() for w in weights)
    print(common.machine_line())
    print(f"model: {ckpt}: {len(weights)} tensors, {count:,} parameters; {args.steps} steps x {args.repeats} "
          f"alternating runs per implementation")
    times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    finals: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, options in IMPLEMENTATIONS.items():
            step_times, finals[name] = run(weights, grads, options, args.steps)
            times[name] += step_times
    reference = finals["python loop (CPU default)"]
    base = statistics.median(times["python loop (CPU default)"])
    common.print_table(
        ["AdamW", "median s/step", "vs python loop", "max |param diff| from the python loop"],
        ([name, f"{statistics.median(ts):.3f}", f"{statistics.median(ts) / base:.2f}",
          f"{max(float((a - b).abs().max()) for a, b in zip(finals[name], reference)):.1e}"]
         for name, ts in times.items()))


if __name__ == "__main__":
    main()
