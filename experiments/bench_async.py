"""Wall clock per training step with asynchronous rollouts (SAO's producer) against synchronous ones.

    .venv/bin/python experiments/bench_async.py [--steps 20] [--repeats 2] [--config configs/sao.yaml]

Each setting is a real ``rl-lightning fit`` of ``--config`` (default: SAO on guess-the-number, 128 episodes per
step) for ``--steps`` steps without validation and without the critic warm-up (every step is a full actor and
critic update), with ``data.async_rollout.queue`` 2 (a background producer generates the next batches while the learner
updates) and 0 (each batch generated when the learner needs it). The settings alternate within each repeat.
Prints, per setting, the median over repeats of the learner's seconds per step (TensorBoard event times of
``train/reward`` from the second step to the last: the first step includes start-up), the mean of
``perf/rollout_time`` (the learner's wait for its batch; the whole generation when synchronous) and of
``perf/update_time``, and the ratio async / sync. Run it on an otherwise idle machine: the producer thread and
the learner share the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]


def run(config: str, queue: int, steps: int, root: str) -> dict[str, float]:
    name = f"async{queue}"
    command = [str(REPO / ".venv/bin/rl-lightning"), "fit", "--config", config, "--data.init_args.async_rollout.queue",
               str(queue), "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
               "--trainer.callbacks", '[{"class_path": "rl_lightning.callbacks.FreezeCriticModules", '
               '"init_args": {"patterns": ["self_attn"]}}]', "--trainer.logger.init_args.save_dir", root,
               "--trainer.logger.init_args.name", name, "--trainer.enable_progress_bar", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    run_dir = sorted(Path(root, name).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    times = [e.wall_time for e in acc.Scalars("train/reward")]
    return {
        "s/step": (times[-1] - times[0]) / (len(times) - 1),
        "rollout_wait": statistics.mean(e.value for e in acc.Scalars("perf/rollout_time")[1:]),
        "update": statistics.mean(e.value for e in acc.Scalars("perf/update_time")[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--config", default="configs/sao.yaml")
    args = parser.parse_args()
    results: dict[int, list[dict[str, float]]] = {2: [], 0: []}
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            for queue in (2, 0):
                results[queue].append(run(args.config, queue, args.steps, root))
                print(f"repeat {repeat} async_queue={queue}: " +
                      ", ".join(f"{k} {v:.3f}" for k, v in results[queue][-1].items()), flush=True)
    median = {q: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for q, rs in results.items()}
    for queue, label in ((2, "async (queue 2)"), (0, "sync")):
        m = median[queue]
        print(f"{label:16s} {m['s/step']:.3f} s/step  (learner waits {m['rollout_wait']:.3f} s for its batch, "
              f"updates {m['update']:.3f} s)")
    print(f"async / sync seconds per step: {median[2]['s/step'] / median[0]['s/step']:.2f}")


if __name__ == "__main__":
    main()
