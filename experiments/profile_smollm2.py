"""Where one SmolLM2-135M GRPO step's time goes: the rollout and the update under ``torch.profiler``, by operator.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/profile_smollm2.py [--workload lora|full] [--equal-work]
        [--prompts 8] [--group 8] [--max-new 32] [--warmup 1] [--model DIR] [--top 12] [--precision fp32|bf16]
        [--trace aten::fill_]

The step is ``bench_vs_trl_smollm2.py``'s (the same module, data and settings, ``build_ours``): after ``--warmup``
unprofiled steps, the next step's rollout (from the end of the previous step to the start of this one: the data
module's ``on_after_batch_transfer``) and its update (``training_step`` and the optimiser step, to the end of the
step) are each recorded by a profiler of their own. Printed per phase: its wall time; the operators' own (self) CPU
time by kind, as a share of the wall time:

* matrix products: ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm`` (the linear layers, the LM head, the decode step's
  attention products), with their FLOPs as the profiler counts them and the rate they ran at, against the fp32
  matrix-product throughput measured in the same process (``torch.matmul`` of 2048 x 2048 matrices, best of 5 before
  and after): the share of the achievable rate the products themselves reach;
* attention: PyTorch's fused scaled-dot-product attention and its backward (the update's forwards);
* softmax: ``softmax`` / ``log_softmax`` / ``logsumexp`` and their backwards (the 49k-entry vocabulary, attention);
* optimiser: every operator inside the optimiser's step (its ``Optimizer.step#...`` range);
* wrappers, views, allocation: ``matmul``, ``linear``, ``view``, ``t``, ``empty``, ... (operators that only dispatch
  to others, make views or allocate: their self time is per-call overhead);
* copies: ``copy_``, ``cat``, ``index_select``, ``index``, ``gather``, ``clone``, ``_to_copy``, ...;
* elementwise and reductions: every other ATen operator (norms, activations, rotary, the sampler's draw);
* outside operators: the wall time no operator accounts for (Python, Lightning, hooks, and the profiler's own cost
  per operator, which is most of it in the rollout's tens of thousands of small operators: compare the phase's wall
  time with the unprofiled step before it, printed too);

then the operators with the most self time, and the matrix products by input shapes with the rate each ran at.
``--trace OP`` (e.g. ``aten::fill_``) records Python stacks too and prints, per phase, where ``OP``'s self time
comes from: its calls grouped by input shapes and the innermost frames of the Python stack that called them
(operators of the backward run in autograd's own thread, without a Python frame: their shapes say where they are).
``--precision bf16``: ``bench_vs_trl_smollm2.py``'s bf16 (bf16-mixed update, bf16 sampler copy).
Read the shares and rates, not the absolute times; time steps with ``bench_vs_trl_smollm2.py``, which runs
unprofiled.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as common
from bench_vs_trl_smollm2 import PRECISIONS, WORKLOADS, build_ours, matmul_flops

MATRIX = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
#: operators that only dispatch to others, make views or allocate (their self time is per-call overhead)
WRAPPERS = frozenset(f"aten::{name}" for name in (
    "matmul", "linear", "t", "view", "reshape", "transpose", "expand", "as_strided", "unsqueeze", "squeeze", "slice",
    "select", "permute", "_unsafe_view", "detach", "empty", "empty_like", "empty_strided", "zeros", "zeros_like",
    "ones_like", "resize_", "_reshape_alias", "alias", "split", "chunk", "narrow", "lift_fresh", "result_type",
    "numpy_T", "contiguous", "flatten", "unbind", "_has_compatible_shallow_copy_type", "to"))
KINDS = (
    ("matrix products", lambda name: name in MATRIX),
    ("attention", lambda name: "scaled_dot_product" in name or "flash_attention" in name),
    ("softmax", lambda name: any(k in name for k in ("softmax", "logsumexp"))),
    ("wrappers, views, allocation", lambda name: name in WRAPPERS),
    ("copies", lambda name: name in ("aten::copy_", "aten::cat", "aten::index_select", "aten::index", "aten::gather",
                                     "aten::clone", "aten::_to_copy", "aten::scatter_",
                                     "aten::index_put_", "aten::_index_put_impl_", "aten::masked_select",
                                     "aten::stack", "aten::embedding_dense_backward", "aten::index_add_")),
    ("elementwise and reductions", lambda name: name.startswith("aten::")),
)
#: the optimiser's step is a profiler range of its own (``Optimizer.step#AdamW.step``): every operator under it counts
OPTIMISER = "Optimizer.step"


def is_python(event: Any) -> bool:
    """An event of the Python tracer (recorded with ``with_stack=True``: ``file.py(line): function``, ``<built-in
    method ...>``), not an operator: its time overlaps the operators it calls, so it is left out of every sum."""
    return event.name.startswith("<built-in") or re.search(r"\.py\(\d+\): ", event.name) is not None


def kind(event: Any) -> str:
    """The kind of a profiler event: ``optimiser`` when it runs inside the optimiser's step, else ``KINDS``' first
    match for its name (``other`` for non-ATen events)."""
    parent = event
    while parent is not None:
        if parent.name.startswith(OPTIMISER):
            return "optimiser"
        parent = parent.cpu_parent
    return next((label for label, match in KINDS if match(event.name)), "other")


def summarise(prof: Any, wall: float) -> tuple[dict[str, float], float, float, list[tuple[str, str, int, float]]]:
    """Self CPU seconds by kind, the matrix products' FLOPs and self seconds, and every operator's (name, kind,
    calls, self seconds), from the profiler's events."""
    by_kind: dict[str, float] = defaultdict(float)
    per_op: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    flops = matrix_s = 0.0
    for event in prof.events():
        if is_python(event):
            continue
        seconds, label = event.self_cpu_time_total / 1e6, kind(event)
        by_kind[label] += seconds
        per_op[event.name, label][0] += 1
        per_op[event.name, label][1] += seconds
        if event.name in MATRIX:
            flops += event.flops or 0
            matrix_s += seconds
    by_kind["outside operators"] = wall - sum(by_kind.values())
    ops = [(name, label, int(calls), seconds) for (name, label), (calls, seconds) in per_op.items()]
    return by_kind, flops, matrix_s, sorted(ops, key=lambda op: -op[3])


def products(prof: Any, top: int) -> list[tuple[str, str, int, float, float]]:
    """The matrix products with the most self time, by operator and input shapes: (operator, shapes, calls, self
    seconds, FLOP/s)."""
    rows = []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in MATRIX and event.self_cpu_time_total > 0:
            seconds = event.self_cpu_time_total / 1e6
            shapes = " x ".join(str(list(s)) for s in event.input_shapes if s)
            rows.append((event.key, shapes, event.count, seconds, (event.flops or 0) / seconds))
    return sorted(rows, key=lambda row: -row[3])[:top]


def traced(prof: Any, op: str, top: int, frames: int = 6) -> list[tuple[str, int, float, str]]:
    """``op``'s calls with the most self time, grouped by input shapes and by the ``frames`` innermost Python frames
    of the stack that called them (the Python tracer's events above it, recorded with ``with_stack=True``):
    (shapes, calls, self seconds, stack)."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.name != op:
            continue
        stack, caller = [], event.cpu_parent
        while caller is not None and len(stack) < frames:
            if is_python(caller) and not caller.name.startswith("<built-in"):
                stack.append(caller.name.split("/")[-1])
            caller = caller.cpu_parent
        shapes = " x ".join(str(list(s)) for s in event.input_shapes if s)
        where = " <- ".join(stack) or "(no Python frame: autograd's thread)"
        groups[shapes, where][0] += 1
        groups[shapes, where][1] += event.self_cpu_time_total / 1e6
    rows = [(shapes, int(calls), seconds, where) for (shapes, where), (calls, seconds) in groups.items()]
    return sorted(rows, key=lambda row: -row[2])[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=list(WORKLOADS), default="lora")
    p.add_argument("--equal-work", action="store_true", help="our update skips no row (as TRL's)")
    common.add_model_option(p)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-new", type=int, default=32, help="most new tokens per completion")
    p.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (the last one's times are printed)")
    p.add_argument("--top", type=int, default=12, help="operators listed per phase")
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="bench_vs_trl_smollm2.py's precisions: bf16 = bf16-mixed update and a bf16 sampler copy")
    p.add_argument("--trace", metavar="OP", help="also print where OP's self time comes from (Python stacks)")
    args = p.parse_args()
    ckpt = common.checkpoint_dir(args.model)

    import torch
    from lightning.pytorch import Callback
    from torch.profiler import ProfilerActivity, profile

    phases: dict[str, tuple[Any, float]] = {}
    unprofiled: dict[str, float] = {}
    running: dict[str, tuple[Any, float]] = {}

    def start(name: str) -> None:
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True,
                       with_stack=args.trace is not None)
        prof.start()
        running[name] = (prof, time.perf_counter())

    def stop(name: str) -> None:
        prof, began = running.pop(name)
        prof.stop()
        phases[name] = (prof, time.perf_counter() - began)

    class Phases(Callback):
        """Rollout: from the end of step ``warmup - 1`` to the start of step ``warmup``; update: that step."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            if "rollout" in running:
                stop("rollout")
                start("update")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            if "update" in running:
                stop("update")
            elif trainer.global_step == args.warmup:
                metrics = trainer.callback_metrics
                unprofiled.update(rollout=float(metrics["perf/rollout_time"]),
                                  update=float(metrics["perf/update_time"]))
                start("rollout")

    print(common.machine_line())
    print(f"model: {ckpt}; {args.workload}; {args.prompts} prompts x G {args.group}, at most {args.max_new} new "
          f"tokens; {'equal work (no row skipped)' if args.equal_work else 'inert rows skipped'}; "
          f"{args.warmup} unprofiled step(s), then one profiled step; {args.precision}")
    module, datamodule = build_ours(args.workload, ckpt, args.prompts, args.group, args.max_new, args.equal_work,
                                    args.warmup + 3, args.precision)
    before = matmul_flops()
    common.fit_ours(module, datamodule, warmup=args.warmup, steps=1, on_batch=lambda *a: None, callbacks=[Phases()],
                    precision=PRECISIONS[args.precision][0])
    peak = max(before, matmul_flops())
    print(f"fp32 matmul (2048 x 2048, {torch.get_num_threads()} thread(s)): {peak / 1e9:.1f} GFLOP/s")
    for name in ("rollout", "update"):
        prof, wall = phases[name]
        by_kind, flops, matrix_s, ops = summarise(prof, wall)
        rate = flops / matrix_s if matrix_s else 0.0
        print(f"\n{name}: {wall:.2f} s wall (unprofiled in the step before: {unprofiled[name]:.2f} s); matrix "
              f"products {flops / 1e9:.0f} GFLOP in {matrix_s:.2f} s = "
              f"{rate / 1e9:.1f} GFLOP/s ({100 * rate / peak:.0f}% of the measured matmul); the whole phase at "
              f"{flops / wall / 1e9:.1f} GFLOP/s ({100 * flops / wall / peak:.0f}%)")
        common.print_table(["kind", "self s", "share of wall"],
                           ([label, f"{s:.2f}", f"{100 * s / wall:.0f}%"]
                            for label, s in sorted(by_kind.items(), key=lambda kv: -kv[1])))
        print()
        common.print_table(["operator", "kind", "calls", "self s", "share of wall"],
                           ([op, label, str(calls), f"{s:.2f}", f"{100 * s / wall:.1f}%"]
                            for op, label, calls, s in ops[:args.top]))
        print()
        common.print_table(["matrix product", "input shapes", "calls", "self s", "GFLOP/s", "of matmul"],
                           ([op, shapes, str(calls), f"{s:.2f}", f"{rate / 1e9:.1f}", f"{100 * rate / peak:.0f}%"]
                            for op, shapes, calls, s, rate in products(prof, args.top)))
        if args.trace:
            print()
            common.print_table([f"{args.trace}: input shapes", "calls", "self s", "Python stack (innermost first)"],
                               ([shapes, str(calls), f"{s:.3f}", stack]
                                for shapes, calls, s, stack in traced(prof, args.trace, args.top)))


if __name__ == "__main__":
    main()
