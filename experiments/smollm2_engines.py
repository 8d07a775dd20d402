"""GRPO on SmolLM2-135M through the built-in engine and through vLLM: the same config, seed and budget, two curves.

    .venv/bin/python experiments/smollm2_engines.py [--steps 100] [--val-every 10] [--seed 0]

Runs (skipping a run already finished: its ``last.ckpt`` reached ``--steps`` with that seed)

* ``.venv/bin/rl-lightning fit --config configs/grpo_smollm2.yaml`` -> ``runs/grpo_smollm2_kvcache``
* ``.venv-vllm/bin/rl-lightning fit --config configs/grpo_smollm2.yaml --config configs/presets/vllm.yaml``
  -> ``runs/grpo_smollm2_vllm``

both with ``--trainer.val_check_interval --val-every`` and ``OMP_NUM_THREADS=1``, one after the other, then writes
``experiments/studies/smollm2_engines/README.md``'s results section (held-out reward per evaluation, step times,
the sampler contract) and ``results.png`` (held-out reward against step and against wall time, side by side).
Needs the checkpoint (``.venv/bin/python experiments/smollm2.py``) and ``.venv-vllm`` (``./install_vllm.sh``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
from report import finished_run, write_section  # noqa: E402

STUDY = REPO / "experiments" / "studies" / "smollm2_engines"
RUNS = {  # name: (interpreter's rl-lightning, extra config)
    "grpo_smollm2_kvcache": (".venv/bin/rl-lightning", None),
    "grpo_smollm2_vllm": (".venv-vllm/bin/rl-lightning", "configs/presets/vllm.yaml"),
}
LABEL = {"grpo_smollm2_kvcache": "KVCacheEngine (built-in)", "grpo_smollm2_vllm": "VLLMEngine (colocated)"}


def train(name: str, steps: int, val_every: int, seed: int) -> Path:
    done = finished_run(name, seed, REPO / "runs")
    if done is not None:
        print(f"== {name}: done ({done})")
        return done
    binary, preset = RUNS[name]
    args = [str(REPO / binary), "fit", "--config", "configs/grpo_smollm2.yaml"]
    args += ["--config", preset] if preset else []
    args += ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(val_every),
             "--seed_everything", str(seed), "--trainer.logger.init_args.name", name]
    print("==", " ".join(args), flush=True)
    subprocess.run(args, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    return finished_run(name, seed, REPO / "runs")


def scalars(run: Path) -> dict[str, list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value, e.wall_time) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def plot(logs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for name, log in logs.items():
        val = log["val/reward"]
        start = min(w for series in log.values() for _, _, w in series)
        by_step.plot([s for s, _, _ in val], [v for _, v, _ in val], marker="o", markersize=3, label=LABEL[name])
        by_time.plot([(w - start) / 60 for _, _, w in val], [v for _, v, _ in val], marker="o", markersize=3,
                     label=LABEL[name])
    by_step.set_xlabel("step (4 prompts x 4 samples)")
    by_time.set_xlabel("wall time (min, shared 2-core CPU)")
    by_step.set_ylabel("val/reward (32 held-out problems, greedy)")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("GRPO on SmolLM2-135M-Instruct (configs/grpo_smollm2.yaml), seed 0")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def section(logs: dict[str, dict], command: str) -> str:
    names = list(logs)
    val = {n: {s: v for s, v, _ in logs[n]["val/reward"]} for n in names}
    steps = sorted(set.intersection(*(set(v) for v in val.values())))
    lines = [f"Command: `{command}` (one seed, the same config and budget for both engines).", "",
             "| step | " + " | ".join(LABEL[n] for n in names) + " |", "| --- |" + " --- |" * len(names)]
    lines += [f"| {s} | " + " | ".join(f"{val[n][s]:.3f}" for n in names) + " |" for s in steps]
    lines += ["", "| | " + " | ".join(LABEL[n] for n in names) + " |", "| --- |" + " --- |" * len(names)]

    def med(n: str, tag: str, fmt: str) -> str:
        values = [v for s, v, _ in logs[n].get(tag, []) if s >= 1]
        return format(statistics.median(values), fmt) if values else "-"

    def last3(n: str) -> str:
        return f"{statistics.mean(val[n][s] for s in steps[-3:]):.3f}"

    def wall_minutes(n: str) -> str:
        times = [w for t in logs[n].values() for _, _, w in t]
        return f"{(max(times) - min(times)) / 60:.0f}"

    for label, cell in (("val/reward at step 0", lambda n: f"{val[n][steps[0]]:.3f}"),
                        (f"mean of the last 3 evaluations (steps {steps[-3]}-{steps[-1]})", last3),
                        ("best", lambda n: f"{max(val[n].values()):.3f}"),
                        ("median perf/step_time (s)", lambda n: med(n, "perf/step_time", ".1f")),
                        ("median perf/rollout_time (s)", lambda n: med(n, "perf/rollout_time", ".1f")),
                        ("median train/sampler_logp_diff", lambda n: med(n, "train/sampler_logp_diff", ".1e")),
                        ("wall time (min)", wall_minutes)):
        lines.append(f"| {label} | " + " | ".join(cell(n) for n in names) + " |")
    lines += ["", "![held-out reward against step and wall time](results.png)", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logs = {name: scalars(train(name, args.steps, args.val_every, args.seed)) for name in RUNS}
    STUDY.mkdir(parents=True, exist_ok=True)
    plot(logs, STUDY / "results.png")
    command = f"python experiments/smollm2_engines.py --steps {args.steps} --val-every {args.val_every}"
    readme = STUDY / "README.md"
    if not readme.exists():
        readme.write_text("# GRPO on SmolLM2-135M: the built-in engine and vLLM\n")
    write_section(readme, "Results", section(logs, command))
    print(f"wrote {readme} and {STUDY / 'results.png'}")


if __name__ == "__main__":
    main()
