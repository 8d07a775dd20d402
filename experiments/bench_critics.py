"""Cost per training step of TEMPO, LVRL and AC2 against GRPO, on the tasks and presets of their study
(``experiments/early_critics.sh``).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_critics.py [--steps 12] [--warmup 8] [--repeats 2]
        [--tasks guess ...]

Each workload is ``rl-lightning fit`` with the method's config, the task preset and the method's preset for the
task (the study's stack), for ``warmup + steps`` steps in a subprocess of its own, from the task's warm start;
TEMPO's warm-up on complete episodes is cut to 4 steps so that the timed steps are its TD phase (horizon ``H``,
saved states replayed, the critic queried at cut ends). Per step it reads ``perf/step_time`` (the whole step,
callbacks included), its parts ``perf/rollout_time`` and ``perf/update_time`` (the rest, ``other``: the reward,
the methods' own rollouts and critic calls outside those two, callbacks, the step's logging) and
``perf/sampled_tokens`` from the run's TensorBoard log, and prints the median over the timed steps of every
repeat, with the ratio of each method's step to GRPO's on the same task. The methods of a task run one after the
other and the order flips every repeat, so machine load falls on all of them alike; compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
from bench_common import machine_line, print_table  # noqa: E402

#: task -> (method, extra command-line arguments) in the study's stacks
WORKLOADS = {
    "guess": [("grpo", []), ("tempo", ["--model.init_args.warmup_steps", "4"]), ("lvrl", [])],
    "calculator": [("grpo", []), ("tempo", ["--model.init_args.warmup_steps", "4"]), ("lvrl", [])],
    "arithmetic_hard": [("grpo", []), ("ac2", [])],
}
TAGS = ("perf/step_time", "perf/rollout_time", "perf/update_time", "perf/sampled_tokens")


def stack(method: str, task: str) -> list[str]:
    configs = [REPO / "configs" / f"{method}.yaml", REPO / "configs" / "tasks" / f"{task}.yaml",
               REPO / "configs" / "tasks" / f"{task}_{method}.yaml"]
    return [arg for path in configs if path.is_file() for arg in ("--config", str(path))]


def run(method: str, task: str, extra: list[str], steps: int, warmup: int, root: Path) -> dict[str, list[float]]:
    """One fit of ``warmup + steps`` steps; each tag's values over the timed steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    name = f"{task}_{method}"
    total = warmup + steps
    cmd = [str(Path(sys.executable).with_name("rl-lightning")), "fit", *stack(method, task), *extra,
           "--trainer.max_steps", str(total), "--trainer.val_check_interval", str(total),
           "--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.name", name,
           "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    log = sorted((root / name).glob("version_*"))[-1]
    acc = EventAccumulator(str(log), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag) if e.step >= warmup] for tag in TAGS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--steps", type=int, default=12, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (TEMPO's warm-up ends at step 4)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    print(machine_line())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks:
            values: dict[str, dict[str, list[float]]] = {m: {t: [] for t in TAGS} for m, _ in WORKLOADS[task]}
            for repeat in range(args.repeats):
                order = WORKLOADS[task] if repeat % 2 == 0 else WORKLOADS[task][::-1]
                for method, extra in order:
                    for tag, vals in run(method, task, extra, args.steps, args.warmup, Path(tmp)).items():
                        values[method][tag] += vals
                    print(f"  {task} {method} repeat {repeat}: median step "
                          f"{statistics.median(values[method]['perf/step_time']):.3f} s", flush=True)
            median = {m: {t: statistics.median(v) for t, v in tags.items()} for m, tags in values.items()}
            base = median["grpo"]["perf/step_time"]
            for method, m in median.items():
                step, roll, upd = m["perf/step_time"], m["perf/rollout_time"], m["perf/update_time"]
                rows.append([task, method, f"{step:.3f}", f"{roll:.3f}", f"{upd:.3f}", f"{step - roll - upd:.3f}",
                             f"{m['perf/sampled_tokens']:,.0f}", f"{step / base:.2f}x",
                             f"{1e3 * step / m['perf/sampled_tokens']:.2f}"])
    print(f"\nmedian over {args.repeats} x {args.steps} timed steps (after {args.warmup})\n")
    print_table(["task", "method", "s / step", "rollout", "update", "other", "sampled tokens / step",
                 "step / GRPO's", "ms / sampled token"], rows)


if __name__ == "__main__":
    main()
