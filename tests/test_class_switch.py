"""A class switch on the command line or in a stacked config says which settings it carried over from the earlier
class (jsonargparse keeps every init_arg the new class accepts): the 2026-methods issue's trap 1."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from rl_lightning.cli_parser import class_switches
from tests.conftest import REPO

GRPO_YAML = str(REPO / "configs" / "grpo.yaml")
WIDE = "tests.helpers.methods.WideClipGRPO"  # defaults clip_eps_low 0.3, clip_eps_high 0.4


def _final(cls: str, low: float, high: float, task: dict | None = None) -> dict:
    return {"model": {"class_path": cls, "init_args": {"clip_eps_low": low, "clip_eps_high": high, "seed": 0}},
            "data": {"class_path": "rl_lightning.rollout.RolloutDataModule", "init_args": {"task": task or {}}}}


def test_a_switch_on_the_command_line_lists_the_carried_values_that_differ_from_the_new_defaults():
    lines = class_switches(["fit", "--config", GRPO_YAML, "--model", WIDE], _final(WIDE, 0.2, 0.2))
    assert len(lines) == 1
    assert lines[0].startswith("model: GRPO -> WideClipGRPO keeps the earlier class's clip_eps_high=0.2 (default "
                               "0.4), clip_eps_low=0.2 (default 0.3)")


def test_values_set_again_after_the_switch_or_equal_to_the_defaults_are_not_listed():
    args = ["fit", "--config", GRPO_YAML, "--model", WIDE, "--model.init_args.clip_eps_low", "0.3",
            "--model.init_args.clip_eps_high=0.25"]
    assert class_switches(args, _final(WIDE, 0.3, 0.25)) == []
    assert class_switches(["fit", "--config", GRPO_YAML], _final("rl_lightning.algorithms.GRPO", 0.2, 0.2)) == []
    # a switch to the same class by another name is no switch
    assert class_switches(["fit", "--config", GRPO_YAML, "--model", "GRPO"],
                          _final("rl_lightning.algorithms.GRPO", 0.2, 0.2)) == []


def test_a_switch_in_a_stacked_config_and_a_nested_task_switch(tmp_path):
    layer = tmp_path / "layer.yaml"
    layer.write_text(yaml.safe_dump({"model": {"class_path": WIDE},
                                     "data": {"init_args": {"task": {
                                         "class_path": "rl_lightning.envs.GuessNumberTask"}}}}))
    task = {"class_path": "rl_lightning.envs.GuessNumberTask", "init_args": {"seed": 99, "max_guesses": 5}}
    first = tmp_path / "first.yaml"
    first.write_text(yaml.safe_dump({"data": {"init_args": {"task": {"class_path": "rl_lightning.envs.ArithmeticTask",
                                                                     "init_args": {"seed": 99}}}}}))
    lines = class_switches(["fit", "--config", GRPO_YAML, "--config", str(first), "--config", str(layer)],
                           _final(WIDE, 0.2, 0.2, task))
    assert any(line.startswith("model: GRPO -> WideClipGRPO") for line in lines)
    assert any(line.startswith("data.init_args.task: ArithmeticTask -> GuessNumberTask keeps the earlier class's "
                               "seed=99 (default 1234)") for line in lines), lines


def test_the_cli_prints_the_carried_values(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rl_lightning", "fit", "--config", GRPO_YAML, "--model", WIDE,
                           "--trainer.max_steps", "0", "--trainer.logger.init_args.save_dir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("rl-lightning: warning: model: GRPO -> WideClipGRPO keeps the earlier class's clip_eps_high=0.2 (default "
            "0.4), clip_eps_low=0.2 (default 0.3)") in proc.stdout + proc.stderr
