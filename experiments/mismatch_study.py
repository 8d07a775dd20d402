"""The sampler/learner mismatch study: what the off-policy corrections buy, on the harder single-turn task.

    .venv/bin/python experiments/mismatch_study.py                 # every run not yet done, then the report
    .venv/bin/python experiments/mismatch_study.py --jobs 2        # two runs at a time (one thread each)
    .venv/bin/python experiments/mismatch_study.py --report-only   # the report from the runs done so far
    .venv/bin/python experiments/mismatch_study.py --probe         # train/sampler_logp_diff of each setting on the
                                                         # embedded default (2-digit), 24 REINFORCE steps each

Methods (each from its own config, stacked with ``configs/tasks/arithmetic_hard.yaml``, 200 steps x 128
responses): REINFORCE, GRPO, GRPO + TIS (``tis_cap: 2``), ScoreCentering (top-8 head), StableReinforce (K = 8
draws). Mismatch settings: the sampler refreshed every 1, 4 or 8 steps (``data.sampling.sync_interval``) in fp32,
and a bf16 copy of the policy as the sampler, refreshed every step (``data.sampling.dtype: bfloat16``). Seeds 0, 1,
2 (the run's seed sets sampling and minibatch order; the task's prompt stream is the same for every run).

Runs land in ``runs/mismatch/<method>_<setting>/version_N``; a run counts as done when its config has the seed
and its ``last.ckpt`` reached ``max_steps``, and done runs are skipped, so rerunning resumes the study. The
report is the section "Sampler/learner mismatch study" of experiments/studies/mismatch/README.md (table of final
held-out reward and of ``train/sampler_logp_diff``, the mean over the run's steps of the token-mean
|log q - log p| before each update) with the plot results_mismatch.png beside it; numbers come only from the logs.
A notes file (experiments/studies/mismatch/results_notes_mismatch.md), when present, is appended.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
from report import finished_run, write_section  # noqa: E402

TASK = "configs/tasks/arithmetic_hard.yaml"
METHODS = {  # name: (label, config, extra overrides)
    "reinforce": ("REINFORCE", "configs/reinforce.yaml", []),
    "grpo": ("GRPO", "configs/grpo.yaml", []),
    "grpo_tis": ("GRPO + TIS (C = 2)", "configs/grpo.yaml", ["--model.init_args.tis_cap", "2.0"]),
    # the plain correction (w = 1), as the study was run; the shipped config adds importance weights (C = 2)
    "score_centering": ("ScoreCentering (top-8)", "configs/score_centering.yaml",
                        ["--model.init_args.importance_cap", "null"]),
    "stable_reinforce": ("StableReinforce (K = 8)", "configs/stable_reinforce.yaml", []),
}
SETTINGS = {  # name: (label, sync interval, sampler dtype)
    "lag1": ("lag 1 (fp32)", 1, "null"),
    "lag4": ("lag 4", 4, "null"),
    "lag8": ("lag 8", 8, "null"),
    "bf16": ("bf16 sampler", 1, "bfloat16"),
}
SECTION = "Sampler/learner mismatch study (3-digit addition)"


def run_name(method: str, setting: str) -> str:
    return f"mismatch/{method}_{setting}"


def done_run(name: str, seed: int) -> Path | None:
    return finished_run(name, seed, REPO / "runs")


def train(method: str, setting: str, seed: int) -> None:
    _, config, extra = METHODS[method]
    _, interval, dtype = SETTINGS[setting]
    command = [
        str(REPO / ".venv/bin/rl-lightning"), "fit", "--config", config, "--config", TASK, *extra,
        "--data.init_args.sampling.sync_interval", str(interval), "--data.init_args.sampling.dtype", dtype,
        "--trainer.logger.init_args.name", run_name(method, setting), "--trainer.enable_progress_bar", "false",
        "--seed_everything", str(seed), "--data.init_args.seed", str(seed), "--model.init_args.seed", str(seed),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    summary = [line for line in out.stdout.splitlines() + out.stderr.splitlines() if line.startswith("rl-lightning:")]
    print(f"== {method} {setting} seed {seed}: rc {out.returncode} {summary[-1] if summary else out.stderr[-400:]}",
          flush=True)


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _cell(values: list[float], fmt: str = ".3f") -> str:
    if not values:
        return "–"
    mean = sum(values) / len(values)
    return f"{mean:{fmt}} [{min(values):{fmt}}–{max(values):{fmt}}]"


def report(seeds: list[int], out: Path, plot: Path, notes: Path) -> None:
    found: dict[tuple[str, str], list[dict]] = {}
    for method in METHODS:
        for setting in SETTINGS:
            for seed in seeds:
                run = done_run(run_name(method, setting), seed)
                if run is not None:
                    found.setdefault((method, setting), []).append({"seed": seed, "path": run, **scalars(run)})
    if not found:
        raise SystemExit("mismatch_study: no finished runs to report")
    starts = [r["val/reward"][0][1] for rs in found.values() for r in rs if r["val/reward"][0][0] == 0]
    header = "| method | " + " | ".join(label for label, *_ in SETTINGS.values()) + " |"
    rule = "| --- |" + " --- |" * len(SETTINGS)
    lines = [
        f"## {SECTION}", "",
        "Generated by `experiments/mismatch_study.py` from the TensorBoard logs of real runs (the command that "
        "rewrites this section: `.venv/bin/python experiments/mismatch_study.py --jobs 2`). 3-digit addition from its "
        "warm "
        f"start (held-out greedy accuracy {sum(starts) / max(len(starts), 1):.3f} at step 0), 200 steps x 128 "
        "responses per method (16 prompts x 8), the same prompt stream for every run; seeds "
        f"{', '.join(map(str, seeds))}. `val/reward`: greedy success on the 500 fixed held-out prompts. The "
        "sampler is the policy (lag 1), a copy refreshed every 4 or 8 steps (`data.sampling.sync_interval`), or a "
        "bf16 copy refreshed every step (`data.sampling.dtype: bfloat16`) against the fp32 learner. Two runs at a "
        "time on 2 CPU cores.", "",
        "### Final held-out reward (step 200; mean over seeds, min–max in brackets)", "", header, rule,
    ]
    for method, (label, *_) in METHODS.items():
        cells = [_cell([r["val/reward"][-1][1] for r in found.get((method, s), [])]) for s in SETTINGS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "### Mean held-out reward over the last four evaluations (steps 125, 150, 175, 200: less noisy than "
              "one evaluation when a run oscillates)", "", header, rule]
    for method, (label, *_) in METHODS.items():
        cells = [_cell([sum(v for _, v in r["val/reward"][-4:]) / 4 for r in found.get((method, s), [])])
                 for s in SETTINGS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "### `train/sampler_logp_diff` (mean over the run's steps of the token-mean |log q − log p| "
              "before each update)", "", header, rule]
    for method, (label, *_) in METHODS.items():
        cells = [_cell([sum(v for _, v in r["train/sampler_logp_diff"]) / len(r["train/sampler_logp_diff"])
                        for r in found.get((method, s), [])], ".1e") for s in SETTINGS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "### Every run", "", "| method | setting | seed | log dir | val/reward (step: value) |",
              "| --- | --- | --- | --- | --- |"]
    for (method, setting), runs in found.items():
        for r in runs:
            series = ", ".join(f"{s}: {v:.3f}" for s, v in r["val/reward"])
            lines.append(f"| {METHODS[method][0]} | {SETTINGS[setting][0]} | {r['seed']} | "
                         f"`{r['path'].relative_to(REPO)}` | {series} |")
    write_plot(found, plot)
    lines += ["", f"![final held-out reward and sampler/learner log-prob gap per mismatch setting]({plot.name})"]
    if notes.is_file():
        lines += ["", notes.read_text().strip()]
    write_section(out, SECTION, "\n".join(lines) + "\n")
    print(f"wrote {out} ({len(found)} method x setting cells) and {plot}")


def write_plot(found: dict[tuple[str, str], list[dict]], plot: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = list(range(len(SETTINGS)))
    for offset, (method, (label, *_)) in enumerate(METHODS.items()):
        shift = (offset - (len(METHODS) - 1) / 2) * 0.08
        for ax, value in ((left, lambda r: r["val/reward"][-1][1]),
                          (right, lambda r: sum(v for _, v in r["train/sampler_logp_diff"])
                           / len(r["train/sampler_logp_diff"]))):
            points = [(x + shift, [value(r) for r in found.get((method, s), [])]) for x, s in zip(xs, SETTINGS)]
            points = [(x, v) for x, v in points if v]
            if not points:
                continue
            line = ax.plot([x for x, _ in points], [sum(v) / len(v) for _, v in points], marker="o",
                           label=label if ax is left else None)[0]
            for x, v in points:
                ax.vlines(x, min(v), max(v), color=line.get_color(), alpha=0.5)
    for ax, title in ((left, "final val/reward (held-out, greedy)"), (right, "train/sampler_logp_diff (run mean)")):
        ax.set_xticks(xs, [label for label, *_ in SETTINGS.values()])
        ax.set_title(title)
        ax.grid(alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8, loc="lower left")
    fig.suptitle("Sampler/learner mismatch, 3-digit addition: mean over seeds, bars min–max")
    fig.tight_layout()
    fig.savefig(plot, dpi=120)


PROBE = {"lag1": (1, "null"), "lag4": (4, "null"), "lag8": (8, "null"), "bf16": (1, "bfloat16"),
         "bf16 + lag4": (4, "bfloat16")}


def probe(steps: int = 24) -> None:
    """Print the mean ``train/sampler_logp_diff`` each mismatch setting produces on the embedded default
    (configs/reinforce.yaml, 2-digit addition), over ``steps`` steps, split into synced and lagged steps."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name, (interval, dtype) in PROBE.items():
            command = [str(REPO / ".venv/bin/rl-lightning"), "fit", "--config", "configs/reinforce.yaml",
                       "--data.init_args.sampling.sync_interval", str(interval), "--data.init_args.sampling.dtype",
                       dtype, "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
                       "--trainer.logger.init_args.save_dir", tmp, "--trainer.logger.init_args.name", "probe",
                       "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]"]
            subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
            runs = sorted(Path(tmp, "probe").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
            diff = scalars(runs[-1])["train/sampler_logp_diff"]
            synced = [v for s, v in diff if s % interval == 0]
            lagged = [v for s, v in diff if s % interval != 0]
            mean = sum(v for _, v in diff) / len(diff)
            print(f"{name:12s} mean {mean:.2e}  synced steps {sum(synced) / len(synced):.2e}" +
                  (f"  lagged steps {sum(lagged) / len(lagged):.2e} (max {max(lagged):.2e})" if lagged else ""),
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (2 cores: at most 2)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--probe", action="store_true", help="only measure each setting's sampler_logp_diff")
    study = REPO / "experiments/studies/mismatch"
    parser.add_argument("--out", type=Path, default=study / "README.md")
    parser.add_argument("--plot", type=Path, default=study / "results_mismatch.png")
    parser.add_argument("--notes", type=Path, default=study / "results_notes_mismatch.md")
    args = parser.parse_args()
    if args.probe:
        return probe()
    if not args.report_only:  # seed-major order: a partial study has every cell at its first seeds
        todo = [(m, s, seed) for seed in args.seeds for s in args.settings for m in args.methods
                if done_run(run_name(m, s), seed) is None]
        print(f"mismatch_study: {len(todo)} runs to do", flush=True)
        with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
            list(pool.map(lambda job: train(*job), todo))
    report(args.seeds, args.out, args.plot, args.notes)


if __name__ == "__main__":
    main()
