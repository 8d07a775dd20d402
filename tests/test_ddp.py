"""Two CPU processes (gloo): ranks draw different prompts and end with identical weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.parametrize("method", ["grpo", "ppo-separate"])
def test_ddp_two_processes_shard_prompts_and_agree_on_weights(method, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "helpers" / "ddp_run.py"), str(tmp_path), method],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["world_size"] == r1["world_size"] == 2
    assert len(r0["prompt_index"]) == len(r1["prompt_index"]) == 2
    for step, (a, b) in enumerate(zip(r0["prompt_index"], r1["prompt_index"])):
        assert len(a) == len(b) == 2  # prompts_per_step=4 split over 2 ranks
        assert not set(a) & set(b), f"step {step}: ranks drew the same prompts"
        assert sorted(a + b) == list(range(4 * step, 4 * step + 4))  # together: the 1-process stream
    assert r0["params"] == r1["params"]
    assert r0["param_sum"] == r1["param_sum"] and r0["param_abs_sum"] == r1["param_abs_sum"]
