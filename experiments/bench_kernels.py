"""What pinning a study's kernel set costs: the median GRPO step time under each kernel set, alternating runs.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_kernels.py                 # avx2 pins vs the CPU's own
    .venv/bin/python experiments/bench_kernels.py --sets avx2 native default --rounds 3 --steps 20

Each run is `rl-lightning fit --config <config>` for ``--steps`` steps without evaluation, in a fresh process with
the kernel set's environment (``study.PINS``; ``native`` sets nothing: PyTorch, MKL and oneDNN pick this CPU's best
kernels). The sets run in turn, ``--rounds`` times, so a load change on the machine hits them alike. Printed: the
median ``perf/step_time`` over the steps after the first of every run of a set, and its ratio to the first set.
Also printed: whether two runs of one set logged bit-identical ``train/loss`` series (same seed, same kernels).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study import BIN, PINS, REPO, cpu_model  # noqa: E402


def one_run(config: str, steps: int, pins: dict[str, str], threads: int, root: Path, name: str) -> dict[str, list]:
    env = {**os.environ, **pins, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    subprocess.run([str(BIN / "rl-lightning"), "fit", "--config", config, "--trainer.max_steps", str(steps),
                    "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
                    "--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.name", name],
                   cwd=REPO, env=env, check=True, capture_output=True)
    run = sorted((root / name).glob("version_*"))[-1]
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in ("perf/step_time", "train/loss")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/grpo.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sets", nargs="+", default=["avx2", "native"], help=f"of {', '.join(PINS)}, native")
    args = parser.parse_args()
    times: dict[str, list[float]] = {s: [] for s in args.sets}
    losses: dict[str, list[list[float]]] = {s: [] for s in args.sets}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in args.sets:
                series = one_run(args.config, args.steps, PINS.get(name, {}), args.threads, Path(tmp), name)
                times[name] += series["perf/step_time"][1:]
                losses[name].append(series["train/loss"])
                print(f"round {round_} {name}: median step {statistics.median(series['perf/step_time'][1:]):.3f} s",
                      flush=True)
    print(f"\n{args.config}, {args.steps} steps x {args.rounds} rounds, {args.threads} thread(s), {cpu_model()}")
    first = statistics.median(times[args.sets[0]])
    for name in args.sets:
        median = statistics.median(times[name])
        same = all(run == losses[name][0] for run in losses[name][1:])
        print(f"{name:8s} median step {median:.3f} s  ratio to {args.sets[0]} {median / first:.3f}  "
              f"runs bit-identical: {'yes' if same else 'NO'}")
    if len(args.sets) > 1:
        a, b = args.sets[:2]
        differ = losses[a][0] != losses[b][0]
        print(f"{a} and {b} give {'different' if differ else 'identical'} train/loss series (same seed)")


if __name__ == "__main__":
    main()
