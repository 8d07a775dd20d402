"""The learner's update with and without one of ``load_policy``'s memory levers: time, peak memory and how far the
numbers move.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_update_levers.py [--lever attention recompute]
        [--workload lora full] [--rows 64] [--new 32] [--steps 3] [--warmup 1] [--repeats 2] [--model DIR]
        [--json FILE]

Levers (``--lever``; each against the policy with the lever off and every other lever on, as ``load_policy`` gives
it):

* ``attention``: Hugging Face's ``sdpa`` against ``sdpa_gqa`` (``rl_lightning.models.attention``);
* ``recompute``: the gated MLPs' and RMS norms' saved activations kept (``saved``) against rebuilt in the backward
  (``recomputed``, ``rl_lightning.models.recompute``).

The update is ``bench_vs_trl_smollm2.py``'s at 8 prompts x G 8: SmolLM2-135M-Instruct (grouped-query attention, 9
query and 3 key/value heads), the apple word problems in its chat template (8 rows a prompt, the prompt run once
per group: ``policy_forward``'s shared prompt forward), ``--new`` response tokens a row (drawn at random: the
arithmetic does not depend on them), the sampled tokens' log-probs under the sampler's distribution, a policy-
gradient loss and its backward; LoRA (``bench_vs_trl_smollm2.LORA``: rank 16 on the attention projections) or full
fine-tuning. Each implementation runs in a subprocess of its own, alternately, ``--repeats`` rounds: after
``--warmup`` updates, ``--steps`` timed ones. Printed per workload and implementation: the median seconds per
update, the process's peak resident memory, and the largest difference from ``sdpa`` of the log-probs and of the
trainable parameters' gradients (absolute, and relative to the gradient's largest entry) from the lever's off
side.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as common

#: per lever: (off, on)
LEVERS = {"attention": ("sdpa", "sdpa_gqa"), "recompute": ("saved", "recomputed")}


def run_worker(impl: str, workload: str, ckpt: Path, rows: int, new: int, steps: int, warmup: int,
               grads_dir: Path) -> dict:
    """One side's updates; the last update's gradients go to ``grads_dir/<impl>.pt`` (the first round's only: a full
    fine-tuning's 135M numbers are too many for the JSON report)."""
    import torch
    from bench_vs_trl_smollm2 import LORA

    from rl_lightning.algorithms.forward import policy_forward, sequences_batch
    from rl_lightning.models.adapters import LoraSettings, add_lora
    from rl_lightning.models.policy import load_policy
    from rl_lightning.models.recompute import recompute_activations

    torch.manual_seed(0)
    model, tok = load_policy(str(ckpt))
    if impl == "sdpa":
        model.set_attn_implementation("sdpa")
    if impl == "saved":
        recompute_activations(model, enable=False)
    if workload == "lora":
        model = add_lora(model, LoraSettings(**LORA))
    model.train()
    ids, mask = common.chat_prompt_batch(tok, rows)
    contexts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    targets = torch.randint(0, len(tok), (rows, new), generator=torch.Generator().manual_seed(1)).tolist()
    batch = sequences_batch(contexts, targets, None, tok.pad_token_id, 1.0, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    times = []
    for step in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logprobs = policy_forward(model, batch, chunk_size=256).logprobs
        (-logprobs.sum() / rows).backward()
        times.append(time.perf_counter() - start)
    if not (grads_dir / f"{impl}.pt").is_file():
        torch.save(torch.cat([p.grad.flatten() for p in params]), grads_dir / f"{impl}.pt")
    return {"step_times": times[warmup:], "peak_rss_mb": common.peak_mb(), "logprobs": logprobs.detach().tolist(),
            "attention": model.config._attn_implementation,
            "recomputed": sum(hasattr(type(m), "_recomputes") for m in model.modules())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lever", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    p.add_argument("--workload", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    p.add_argument("--rows", type=int, default=64, help="rows of the update (8 a prompt)")
    p.add_argument("--new", type=int, default=32, help="response tokens a row")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the summary here")
    p.add_argument("--worker", choices=[i for pair in LEVERS.values() for i in pair], help=argparse.SUPPRESS)
    p.add_argument("--run-workload", choices=["lora", "full"], help=argparse.SUPPRESS)
    p.add_argument("--grads-dir", type=Path, help=argparse.SUPPRESS)
    common.add_model_option(p)
    args = p.parse_args()
    if args.worker:
        common.worker_report(lambda: run_worker(args.worker, args.run_workload, args.model, args.rows, args.new,
                                                args.steps, args.warmup, args.grads_dir))
        return
    import torch

    ckpt = common.checkpoint_dir(args.model)
    print(common.machine_line(f"; {args.rows} rows, {args.new} new tokens, {args.steps} timed updates after "
                              f"{args.warmup}, {args.repeats} alternating rounds"), flush=True)
    summary, rows_out = {}, []
    for lever, workload in ((lever, workload) for lever in args.lever for workload in args.workload):
        grads_dir = Path(tempfile.mkdtemp(prefix="bench_update_levers_"))
        argv = ["--run-workload", workload, "--model", str(ckpt), "--rows", str(args.rows), "--new", str(args.new),
                "--steps", str(args.steps), "--warmup", str(args.warmup), "--grads-dir", str(grads_dir)]
        runs = common.alternate(__file__, LEVERS[lever], args.repeats, argv, f"{lever}/{workload}",
                                lambda run: f", peak RSS {run['peak_rss_mb']:.0f} MB ({run['attention']}, "
                                            f"{run['recomputed']} modules recomputing)")
        ref = runs[LEVERS[lever][0]][0]
        ref_grads = torch.load(grads_dir / f"{LEVERS[lever][0]}.pt")
        scale = float(ref_grads.abs().max())
        for impl in LEVERS[lever]:
            first = runs[impl][0]
            step = statistics.median(t for run in runs[impl] for t in run["step_times"])
            rss = statistics.median(run["peak_rss_mb"] for run in runs[impl])
            dlogp = max(abs(a - b) for row_a, row_b in zip(first["logprobs"], ref["logprobs"])
                        for a, b in zip(row_a, row_b))
            dgrad = float((torch.load(grads_dir / f"{impl}.pt") - ref_grads).abs().max())
            summary[f"{lever}/{workload}/{impl}"] = {"s_per_update": step, "peak_rss_mb": rss, "logprob_diff": dlogp,
                                             "grad_diff": dgrad, "grad_diff_rel": dgrad / scale}
            rows_out.append([lever, workload, impl, f"{step:.2f}", f"{rss:.0f}", f"{dlogp:.1e}",
                             f"{dgrad:.1e} ({dgrad / scale:.1e})"])
        shutil.rmtree(grads_dir)
    common.print_table(["lever", "workload", "side", "s/update", "peak RSS MB", "max |Δ log-prob|",
                        "max |Δ grad| (rel.)"], rows_out)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
