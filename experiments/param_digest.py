"""Fingerprint of a short fit of every shipped config: parameter digest and every logged number.

The guard rail of a behaviour-preserving refactor: run it before and after, compare the two JSON files.

    .venv/bin/python experiments/param_digest.py --out before.json                # every config, 2 steps each
    .venv/bin/python experiments/param_digest.py --out after.json --compare before.json
    .venv/bin/python experiments/param_digest.py --configs configs/grpo.yaml      # one config

A config ``a.yaml+b.yaml`` stacks ``b`` after ``a`` (a task preset after a method). Each config runs in its own
process with one thread (the same seed gives the same run bitwise), for ``--steps`` rollout steps with the config's
own batch sizes and methods settings, a held-out evaluation of 16 prompts before the first and after every step, no
checkpoints written and no run directory. Recorded: the SHA-256 of every trainable parameter's bytes (policy and
critic, in ``named_parameters`` order) and every scalar logged at every step, written with ``repr`` so that two
runs compare bit for bit. ``--compare`` prints each config whose parameters or numbers differ (with the largest
absolute difference per metric) and exits 1 if any does.

Run against another checkout's code with ``PYTHONPATH=<checkout> .venv/bin/python experiments/param_digest.py ...``
(the script prints which ``rl_lightning`` it imported).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml")
                         if p.name != "grpo_smollm2.yaml") + [
    "configs/grpo.yaml+configs/tasks/guess.yaml", "configs/reinforce.yaml+configs/tasks/calculator.yaml",
    "configs/ppo.yaml+configs/tasks/guess.yaml+configs/tasks/guess_ppo.yaml",
    "configs/cope.yaml+configs/tasks/guess.yaml",
    "configs/ablations/reinforce_lag4.yaml", "configs/ablations/sao_sync.yaml",
]


def _child(config: str, steps: int, out: str) -> None:
    import torch
    from lightning.pytorch.loggers import Logger

    torch.set_num_threads(1)
    import rl_lightning
    from rl_lightning.cli import build_cli

    class Recorder(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.points: dict[str, dict[str, str]] = {}

        @property
        def name(self) -> str:
            return "digest"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            for key, value in metrics.items():
                if key.startswith(("perf/", "epoch")):
                    continue  # wall-clock timings and Lightning's epoch counter
                self.points.setdefault(key, {})[str(step)] = repr(float(value))

    with tempfile.TemporaryDirectory() as root:
        args = [arg for part in config.split("+") for arg in ("--config", part)]
        args += [f"--trainer.max_steps={steps}", "--trainer.logger=false",
                 f"--trainer.default_root_dir={root}", "--trainer.val_check_interval=1",
                 "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
                 "--data.init_args.evaluation.batch_size=16"]
        cli = build_cli(args, run=False, save_config=False)
        recorder = Recorder()
        cli.trainer.loggers = [recorder]
        for cb in list(cli.trainer.callbacks):
            if type(cb).__name__ == "ModelCheckpoint":
                cli.trainer.callbacks.remove(cb)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        digest = hashlib.sha256()
        for name, param in cli.model.named_parameters():
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().numpy().tobytes())
        result = {"params": digest.hexdigest(), "metrics": recorder.points, "rl_lightning": rl_lightning.__file__}
    Path(out).write_text(json.dumps(result, indent=1, sort_keys=True))


def _compare(before: dict[str, Any], after: dict[str, Any]) -> int:
    bad = 0
    for config in sorted(set(before) & set(after)):
        b, a = before[config], after[config]
        problems = []
        if b["params"] != a["params"]:
            problems.append("parameters differ")
        for key in sorted(set(b["metrics"]) | set(a["metrics"])):
            bm, am = b["metrics"].get(key), a["metrics"].get(key)
            if bm is None or am is None:
                problems.append(f"{key}: only {'before' if am is None else 'after'}")
            elif bm != am:
                steps = sorted(set(bm) | set(am), key=int)
                worst = max((abs(float(bm.get(s, "nan")) - float(am.get(s, "nan"))) for s in steps), default=0)
                problems.append(f"{key}: differs (max |diff| {worst:.3g})")
        if problems:
            bad += 1
            print(f"{config}: " + "; ".join(problems))
        else:
            print(f"{config}: identical")
    for config in sorted(set(before) ^ set(after)):
        print(f"{config}: only in {'before' if config in before else 'after'}")
    return 1 if bad else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the fingerprints here (JSON)")
    parser.add_argument("--compare", default=None, help="a JSON of an earlier run to compare against")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], args.steps, args.child[1])
        return
    results: dict[str, Any] = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            out = str(Path(tmp) / "one.json")
            proc = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--child", config, out],
                                  cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{config}: FAILED\n{proc.stderr[-3000:]}")
                results[config] = {"params": "failed", "metrics": {}}
                continue
            results[config] = json.loads(Path(out).read_text())
            print(f"{config}: {results[config]['params'][:16]} ({results[config]['rl_lightning']})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True))
    if args.compare:
        sys.exit(_compare(json.loads(Path(args.compare).read_text()), results))


if __name__ == "__main__":
    main()
