"""Read TensorBoard logs of finished runs and write the results table and plot.

    .venv/bin/python experiments/report.py runs/grpo/version_* ... --out experiments/studies/arithmetic/README.md \
        --plot experiments/studies/arithmetic/results.png --section "Embedded default: 2-digit addition"
    .venv/bin/python experiments/report.py runs/grpo_arithmetic_hard/version_* ... \
        --out experiments/studies/arithmetic_hard/README.md \
        --plot experiments/studies/arithmetic_hard/results_arithmetic_hard.png \
        --section "Harder single-turn setting: 3-digit addition"

For each run directory (a TensorBoard ``log_dir`` holding ``events.out.tfevents.*`` and the ``config.yaml`` that
LightningCLI saves) it reports: method, seed, warm-start ``val/reward`` (step 0, before any update), final and best
``val/reward``, steps, and wall time (first to last event). Runs of one method (several seeds) are summarised
together; the plot shows each method's mean ``val/reward`` (held-out, greedy) against the step with the min–max
band over seeds. Numbers come only from the logs.

Without ``--section`` the report is the whole of ``--out``. With ``--section TITLE`` it is one ``## TITLE`` section
of ``--out``, between ``<!-- report-section: TITLE -->`` and ``<!-- /report-section -->`` markers: a section of
that title already there is replaced, otherwise it is appended, and the rest of the file is kept. A whole-file
report keeps the marked sections of the file it replaces (after its own content), so rerunning one table never
deletes another. A study's README.md under experiments/studies/ is written by sections (``--section``), which
keeps its title and introduction; experiments/run_methods.sh does that.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


@dataclass
class Run:
    path: Path
    method: str
    seed: str
    val: list[tuple[int, float]]
    train: list[tuple[int, float]]
    wall_time_s: float
    steps: int
    # perf/sampled_tokens per step (runs before it was logged: [])
    sampled: list[tuple[int, float]] = field(default_factory=list)
    step_time: list[tuple[int, float]] = field(default_factory=list)  # perf/step_time per step
    setup: str = "?"  # warm start, prompts x group and max_steps, read from the run's config.yaml

    def compute_at(self, step: int, kind: str) -> float:
        """The compute spent before the evaluation at ``step`` (after ``step`` updates): the sum over training
        steps ``< step`` of the tokens sampled (``kind="tokens"``) or of the step's wall clock (``"seconds"``)."""
        series = self.sampled if kind == "tokens" else self.step_time
        return sum(v for s, v in series if s < step)


def load_run(path: Path) -> Run:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    if "val/reward" not in tags:
        raise SystemExit(f"{path}: no val/reward scalar (is this a TensorBoard log_dir of an rl-lightning run?)")
    val = [(e.step, e.value) for e in acc.Scalars("val/reward")]
    train = [(e.step, e.value) for e in acc.Scalars("train/reward")] if "train/reward" in tags else []
    times = [e.wall_time for tag in tags for e in acc.Scalars(tag)]
    method, seed = "?", "?"
    config = path / "config.yaml"
    if config.is_file():
        cfg = yaml.safe_load(config.read_text())
        method = str(cfg.get("model", {}).get("class_path", "?")).rsplit(".", 1)[-1]
        logger = (cfg.get("trainer", {}).get("logger") or {})
        name = str((logger.get("init_args") or {}).get("name", "")) if isinstance(logger, dict) else ""
        if name.startswith("ablations/"):  # configs/ablations/<method>_<variant>.yaml: keep it apart from the method
            method = f"{method} [{'_'.join(name.removeprefix('ablations/').split('_')[:2])}]"
        seed = str(cfg.get("seed_everything", "?"))
        data = (cfg.get("data") or {}).get("init_args") or {}
        setup = (f"`{(cfg.get('model') or {}).get('init_args', {}).get('model_name_or_path', '?')}`, "
                 f"{data.get('prompts_per_step', '?')} x {data.get('group_size', '?')}, "
                 f"{(cfg.get('trainer') or {}).get('max_steps', '?')} steps")
    else:
        setup = "?"
    steps = max([s for s, _ in train] + [s for s, _ in val] + [0])
    series = {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) if tag in tags else []
              for tag in ("perf/sampled_tokens", "perf/step_time")}
    return Run(path, method, seed, sorted(val), sorted(train), max(times) - min(times), steps,
               series["perf/sampled_tokens"], series["perf/step_time"], setup)


def finished_run(name: str, seed: int, root: Path = Path("runs")) -> Path | None:
    """The first ``root/name/version_*`` whose config has ``seed`` and whose ``last.ckpt`` reached the config's
    ``max_steps`` (a finished run, which run_methods.sh and mismatch_study.py skip), or ``None``."""
    import torch

    for run in sorted(root.joinpath(name).glob("version_*")):
        try:
            config = yaml.safe_load((run / "config.yaml").read_text())
            step = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]
        except (OSError, KeyError, TypeError, yaml.YAMLError):
            continue
        if config.get("seed_everything") == seed and step == config["trainer"]["max_steps"]:
            return run
    return None


def _by_method(runs: list[Run]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.method, []).append(run)
    return groups


def _final(run: Run) -> float:
    return run.val[-1][1]


SECTION_END = "<!-- /report-section -->"
_SECTION = re.compile(r"<!-- report-section: (?P<title>.*?) -->\n.*?" + re.escape(SECTION_END) + r"\n?", re.S)


def _section_start(title: str) -> str:
    return f"<!-- report-section: {title} -->"


def report_lines(runs: list[Run], plot: Path | None, command: str, notes: str = "", section: str | None = None,
                 heldout: str = "500 fixed held-out prompts") -> list[str]:
    """The report as markdown lines: a whole document, or (``section``) one ``## section`` of one."""
    h = "###" if section else "##"
    lines = [
        f"## {section}" if section else "# Results",
        "",
        f"Generated by `experiments/report.py` on {dt.date.today().isoformat()} "
        "from the TensorBoard logs of real runs.",
        f"`val/reward` is the mean greedy reward (success) on the task's {heldout}; step 0 is the warm",
        "start before any update. Each method's warm start, prompts x group size and budget are those of its config",
        "(below, read from each run's config.yaml; where methods differ, so do their budgets); the run's seed sets",
        "sampling and minibatch order. Wall time is from the run's first to last logged event on the machine that",
        "ran it (fp32). A pre-protocol report: no interval, no paired test (docs/results.md#the-protocol).",
        "",
        "Setups: " + "; ".join(f"{m}: {', '.join(sorted({r.setup for r in g}))}" for m, g in _by_method(runs).items()),
        "",
        f"Command: `{command}`",
        "",
        f"{h} Summary (mean over seeds; min–max in brackets)",
        "",
        "| method | seeds | warm start (step 0) | final | best during run | steps | wall time / run |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method, group in _by_method(runs).items():
        finals = [_final(r) for r in group]
        bests = [max(v for _, v in r.val) for r in group]
        starts = [r.val[0][1] for r in group if r.val and r.val[0][0] == 0]
        start = f"{sum(starts) / len(starts):.3f}" if starts else "n/a"
        lines.append(
            f"| {method} | {len(group)} | {start} | {sum(finals) / len(finals):.3f} "
            f"[{min(finals):.3f}–{max(finals):.3f}] | {sum(bests) / len(bests):.3f} | "
            f"{max(r.steps for r in group)} | {sum(r.wall_time_s for r in group) / len(group) / 60:.1f} min |"
        )
    if all(r.sampled and r.step_time for r in runs):
        lines += equal_compute_lines(runs, h)
    lines += ["", f"{h} Every run", "", "| method | seed | log dir | val/reward at each evaluation (step: value) |",
              "| --- | --- | --- | --- |"]
    for run in runs:
        series = ", ".join(f"{s}: {v:.3f}" for s, v in run.val)
        lines.append(f"| {run.method} | {run.seed} | `{run.path}` | {series} |")
    if plot is not None:
        what = "step, sampled tokens and training wall time" if all(r.sampled for r in runs) else "step"
        lines += ["", f"![held-out reward against {what}]({plot.name})"]
    if notes:
        lines += ["", notes.strip()]
    return lines


def at_compute(run: Run, budget: float, kind: str) -> float:
    """``val/reward`` of ``run`` when it had spent ``budget`` (``Run.compute_at``), linear between evaluations."""
    points = [(run.compute_at(s, kind), v) for s, v in run.val]
    for (x0, v0), (x1, v1) in zip(points, points[1:]):
        if x0 <= budget <= x1:
            return v0 if x1 == x0 else v0 + (v1 - v0) * (budget - x0) / (x1 - x0)
    raise ValueError(f"{run.path}: budget {budget} outside its evaluations ({points[0][0]}..{points[-1][0]})")


def equal_compute_lines(runs: list[Run], h: str) -> list[str]:
    """The table of what each method reached at the compute every run got to: the fewest sampled tokens (and the
    least training wall time) of any run, each run's ``val/reward`` there (linear between its evaluations)."""
    tokens = min(r.compute_at(r.val[-1][0], "tokens") for r in runs)
    seconds = min(r.compute_at(r.val[-1][0], "seconds") for r in runs)
    lines = ["", f"{h} At equal compute (mean over seeds; min–max in brackets)", "",
             "Sampled tokens (`perf/sampled_tokens`) are every token the policy sampled for training -- the training",
             "rollouts and the methods' and callbacks' one-off rollouts (completions, audits); not held-out",
             "evaluation, nor value tokens scored or sampled by a critic (those count in the wall time). Training",
             "wall time is the sum of `perf/step_time` (rollout, update and callbacks; not evaluation). The budgets",
             f"are what every run reached: {tokens:,.0f} tokens and {seconds:.1f} s; `val/reward` there is linear",
             "between a run's evaluations.", "",
             f"| method | tokens / step | s / step | val/reward at {tokens:,.0f} tokens "
             f"| at {seconds:.1f} s of training |",
             "| --- | --- | --- | --- | --- |"]
    for method, group in _by_method(runs).items():
        per_step = [sum(v for _, v in r.sampled) / len(r.sampled) for r in group]
        step_s = [sum(v for _, v in r.step_time) / len(r.step_time) for r in group]
        cells = []
        for budget, kind in ((tokens, "tokens"), (seconds, "seconds")):
            vals = [at_compute(r, budget, kind) for r in group]
            cells.append(f"{sum(vals) / len(vals):.3f} [{min(vals):.3f}–{max(vals):.3f}]")
        lines.append(f"| {method} | {sum(per_step) / len(per_step):,.0f} | {sum(step_s) / len(step_s):.3f} | "
                     f"{cells[0]} | {cells[1]} |")
    return lines


def write_table(runs: list[Run], out: Path, plot: Path | None, command: str, notes: str = "",
                section: str | None = None, heldout: str = "500 fixed held-out prompts") -> None:
    """Write the report into ``out``: the whole file, or (``section``) its marked section of that title."""
    write_section(out, section, "\n".join(report_lines(runs, plot, command, notes, section, heldout)) + "\n")


def write_section(out: Path, section: str | None, body: str) -> None:
    """Write ``body`` as the whole of ``out`` (keeping its marked sections after it), or as its marked section
    ``section`` (replacing one of that title, else appended)."""
    old = out.read_text() if out.is_file() else ""
    if section is None:
        kept = "\n".join(m.group(0).rstrip("\n") + "\n" for m in _SECTION.finditer(old))
        out.write_text(body + ("\n" + kept if kept else ""))
        return
    if "\n" in section or "-->" in section:
        raise SystemExit(f"--section {section!r}: a title is one line without '-->'")
    block = f"{_section_start(section)}\n{body}{SECTION_END}\n"
    for match in _SECTION.finditer(old):
        if match.group("title") == section:
            out.write_text(old[: match.start()] + block + old[match.end():])
            return
    out.write_text(old.rstrip("\n") + "\n\n" + block if old.strip() else block)


def write_plot(runs: list[Run], plot: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ["step"] + (["tokens", "seconds"] if all(r.sampled and r.step_time for r in runs) else [])
    fig, axes = plt.subplots(1, len(kinds), figsize=(8 if len(kinds) == 1 else 15, 4.5), squeeze=False)
    labels = {"step": "step (rollout batches)", "tokens": "sampled tokens (cumulative perf/sampled_tokens)",
              "seconds": "training wall time, s (cumulative perf/step_time)"}
    for ax, kind in zip(axes[0], kinds):
        for method, group in _by_method(runs).items():
            steps = sorted({s for r in group for s, _ in r.val})
            per_step = [[v for r in group for s2, v in r.val if s2 == s] for s in steps]
            xs = steps if kind == "step" else [  # the mean over seeds of the compute spent by each evaluation
                sum(spent) / len(spent) for spent in
                ([r.compute_at(s, kind) for r in group if s in dict(r.val)] for s in steps)]
            mean = [sum(v) / len(v) for v in per_step]
            line = ax.plot(xs, mean, marker="o", markersize=3, label=f"{method} ({len(group)} seed(s))")[0]
            if len(group) > 1:
                ax.fill_between(xs, [min(v) for v in per_step], [max(v) for v in per_step],
                                color=line.get_color(), alpha=0.15)
        ax.set_xlabel(labels[kind])
        ax.set_ylabel("val/reward (held-out, greedy)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    heading = f"{title}: mean over seeds; shaded: min–max" if title else "Mean over seeds; shaded: min–max"
    (axes[0][0].set_title if len(kinds) == 1 else fig.suptitle)(heading)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="TensorBoard log dirs of finished runs")
    parser.add_argument("--out", type=Path, required=True,
                        help="the markdown file, e.g. experiments/studies/<study>/README.md")
    parser.add_argument("--plot", type=Path, required=True,
                        help="the plot, beside --out (the report links it by file name)")
    parser.add_argument("--command", default="rl-lightning fit --config configs/grpo.yaml",
                        help="the training command, quoted in the report")
    parser.add_argument("--notes", type=Path, help="a markdown file appended to the report (observations)")
    parser.add_argument("--section", help="write the report as the section of this title in --out (replacing a "
                        "previous one of that title, keeping the rest of the file) instead of the whole file")
    parser.add_argument("--heldout", default="500 fixed held-out prompts",
                        help="what val/reward is measured on, as the header says it (e.g. '31 held-out secrets')")
    args = parser.parse_args()
    runs = [load_run(p) for p in args.runs]
    write_plot(runs, args.plot, title=args.section)
    write_table(runs, args.out, args.plot, args.command, args.notes.read_text() if args.notes else "",
                section=args.section, heldout=args.heldout)
    for run in runs:
        print(f"{run.method} seed {run.seed}: val/reward {run.val[0][1]:.3f} -> {run.val[-1][1]:.3f} "
              f"(best {max(v for _, v in run.val):.3f}) in {run.steps} steps, {run.wall_time_s / 60:.1f} min")
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
