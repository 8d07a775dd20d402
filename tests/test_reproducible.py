"""The same seed gives the same run, bitwise, with 2 threads on busy cores; and a resumed run is the straight one.

Operations that accumulate with atomics across threads (an accumulating ``index_put_``, the backward of indexing a
tensor with repeated rows) add in an order that depends on thread timing: two runs then differ in the last bits,
and only when the cores are contended. So each run here goes through the command line with 2 torch threads while
two other processes keep both cores busy. The weights of the last checkpoints are compared with ``torch.equal``:
the runs execute the same operations on the same inputs, so any difference is a non-deterministic operation.
(Before ``rollout.generation.repeat_cache_rows`` the shared prompt forward's backward was such an operation:
30 of 39 tensors differed by up to 1.1e-7 after 3 steps of this run.) Whether a race shows in one pair of runs
depends on timing, so the operation itself is also checked for, without timing: no accumulating ``index_put``
runs in a training step.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning.pytorch import Callback

from rl_lightning.algorithms import GRPO
from tests.conftest import REPO, RecordRollouts, tiny_datamodule, tiny_trainer

#: configs/grpo.yaml cut to a few seconds a step: 16 prompts x 8 responses (the shared-prompt forward's
#: shape), a small held-out set
SHORT = [
    "--config", str(REPO / "configs" / "grpo.yaml"),
    "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", "logs",
    "--data.init_args.task.init_args.num_heldout", "16", "--data.init_args.evaluation.batch_size", "16",
    "--trainer.enable_progress_bar", "false",
]


@contextmanager
def _busy_cores(n: int = 2) -> Iterator[None]:
    """``n`` processes spinning until the block ends (a loaded machine, where thread timing varies)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _fit(root: Path, *args: str) -> dict[str, torch.Tensor]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    root.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "rl_lightning", "fit", *SHORT,
                           "--trainer.default_root_dir", str(root), *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ckpt,) = root.rglob("last.ckpt")
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]


def _logged(*roots: Path) -> dict[int, dict[str, str]]:
    """The step-logged scalars of the runs under ``roots`` (a run and its resumption: each logs its own steps), as
    the CSV logger wrote them (every float's digits; the timing columns left out)."""
    rows: dict[int, dict[str, str]] = {}
    for path in [p for root in roots for p in sorted(root.rglob("metrics.csv"))]:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                kept = {k: v for k, v in row.items() if v and k != "step" and not k.startswith(("perf/", "time/"))
                        and "time" not in k}
                rows.setdefault(int(row["step"]), {}).update(kept)
    return rows


def _first_divergence(a: list[Path], b: list[Path]) -> str:
    """Where two runs' logged scalars first differ: a step's rollout (rewards, lengths) or only its update."""
    la, lb = _logged(*a), _logged(*b)
    for step in sorted(set(la) & set(lb)):
        differ = {k: (la[step][k], lb[step].get(k)) for k in la[step] if k in lb[step] and la[step][k] != lb[step][k]}
        if differ:
            return f"first logged difference at step {step}: {differ}"
    return f"no logged scalar differs (steps {sorted(set(la) & set(lb))})"


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str = "") -> None:
    assert a.keys() == b.keys()
    differ = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not differ, f"{len(differ)} of {len(a)} tensors differ ({where}; {_machine()}): {differ}"


def _machine() -> str:
    """The CPU, the kernel set torch dispatches to and its threads (a failure names the setup it happened on)."""
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU") if os.path.exists("/proc/cpuinfo") else "unknown CPU"
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores"


class _AccumulatingIndexOps(TorchDispatchMode):
    """Records every operation that CPU threads may accumulate in a timing-dependent order: an accumulating
    ``index_put`` (the backward of ``x[index]``) and an accumulating ``put_`` -- the CPU operations that
    ``torch.use_deterministic_algorithms`` switches to another implementation."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func.name()
        if name.startswith(("aten::index_put", "aten::_index_put_impl", "aten::put")):
            accumulate = kwargs.get("accumulate", next((a for a in args[2:] if isinstance(a, bool)), False))
            if accumulate:
                self.seen.append(f"{name} into {tuple(args[0].shape)}")
        return func(*args, **kwargs)


class _SpyOnTrainingSteps(Callback):
    def __init__(self) -> None:
        self.spy = _AccumulatingIndexOps()

    def on_train_batch_start(self, *args) -> None:  # noqa: ANN002
        self.spy.__enter__()

    def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
        self.spy.__exit__(None, None, None)


def test_the_update_runs_no_operation_that_accumulates_in_thread_order(tmp_path):
    """Two steps of configs/grpo.yaml's shape (16 prompts x 8: the shared prompt forward, skipping and length
    bucketing all act): the backward sums a prompt's rows into its shared keys and values with ``index_add`` (in
    index order), not with an accumulating ``index_put`` (atomics across threads, which made two runs differ)."""
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:arithmetic")
    dm = tiny_datamodule(prompts_per_step=16, group_size=8, max_new_tokens=6)
    record, spy = RecordRollouts(), _SpyOnTrainingSteps()
    tiny_trainer(tmp_path, max_steps=2, callbacks=[record, spy]).fit(module, datamodule=dm)
    assert len(record.rewards) == 2 and all(m["train/skipped_rows"] < 1 for m in record.metrics)  # rows forwarded
    assert spy.spy.seen == [], spy.spy.seen


def test_the_same_seed_gives_the_same_weights_with_two_threads_on_busy_cores(tmp_path):
    with _busy_cores():
        first = _fit(tmp_path / "a", "--trainer.max_steps", "3")
        second = _fit(tmp_path / "b", "--trainer.max_steps", "3")
    _assert_bitwise_equal(first, second, _first_divergence([tmp_path / "a"], [tmp_path / "b"]))


@pytest.mark.slow  # 3 CLI fits on busy cores, ~3 min; tests/test_contract.py checks resume bitwise for every method
def test_a_resumed_run_is_the_straight_run_bitwise(tmp_path):
    with _busy_cores():
        straight = _fit(tmp_path / "straight", "--trainer.max_steps", "4")
        _fit(tmp_path / "first", "--trainer.max_steps", "2")
        (ckpt,) = (tmp_path / "first").rglob("last.ckpt")
        resumed = _fit(tmp_path / "resumed", "--trainer.max_steps", "4", "--ckpt_path", str(ckpt))
    _assert_bitwise_equal(straight, resumed, _first_divergence([tmp_path / "straight"],
                                                                 [tmp_path / "first", tmp_path / "resumed"]))
