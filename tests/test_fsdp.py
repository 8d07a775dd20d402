"""FSDP2 on 2 CPU processes (gloo, Lightning's ``ModelParallelStrategy``): it trains, clips globally, agrees with
DDP and resumes exactly. One run per setting (``tests/helpers/fsdp_run.py``); every check reads what it dumped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.tolerances import gamma_probabilistic

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
STEPS = 2  # the AdamW runs' steps
SGD_LR = 1e-3  # tests/helpers/fsdp_run.py's plain-SGD learning rate


def _run(out: Path, kind: str, steps: int, opt: str, resume: Path | None = None) -> list[dict]:
    args = [sys.executable, str(REPO / "tests" / "helpers" / "fsdp_run.py"), str(out), kind, str(steps), opt]
    proc = subprocess.run(args + ([str(resume)] if resume else []), cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp")
    fsdp = _run(root / "fsdp", "fsdp", STEPS, "adam")
    first = sorted((root / "fsdp" / "ckpt").glob("*step=1.ckpt"))
    assert first, "no step-1 checkpoint"
    return {"fsdp": fsdp, "resumed": _run(root / "resumed", "fsdp", STEPS, "adam", resume=first[0]),
            "fsdp_sgd": _run(root / "fsdp_sgd", "fsdp", 1, "sgd"), "ddp_sgd": _run(root / "ddp_sgd", "ddp", 1, "sgd"),
            "initial": _initial()}


def _initial() -> dict[str, torch.Tensor]:
    from rl_lightning.models.policy import load_policy

    return {k: v.clone() for k, v in load_policy("embedded:arithmetic", "float32")[0].state_dict().items()}


def test_fsdp_trains_and_its_ranks_hold_the_same_full_weights(runs):
    a, b = runs["fsdp"]
    assert a["step"] == b["step"] == STEPS
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def test_fsdp_clips_on_the_global_gradient_norm(runs):
    """The norm the clip uses (and logs) is the norm of the whole gradient, as under DDP, whose ranks hold all of it:
    at step 0 both runs have the same weights and data, so the same gradient, its squares summed in another order
    (shard by shard, then over ranks): equal within that sum's rounding, relative ``gamma(D)`` (probabilistic). A
    norm of one rank's shard alone would be about ``1/sqrt(2)`` of it. The AdamW run clips at every step."""
    fsdp, ddp = runs["fsdp_sgd"][0]["grad_norms"][0], runs["ddp_sgd"][0]["grad_norms"][0]
    params = sum(v.numel() for v in runs["initial"].values())
    assert abs(fsdp - ddp) <= 2 * gamma_probabilistic(params) * ddp, (fsdp, ddp)
    assert all(n > 0.05 for n in runs["fsdp"][0]["grad_norms"])  # max_grad_norm 0.05: the clip acted


def test_fsdp_gradient_step_agrees_with_ddp(runs):
    """One plain SGD step from the same weights on the same data: ``θ1 = θ0 - lr g`` in both runs, the gradient
    computed by the same per-rank forwards and backwards and averaged by another collective (FSDP's reduce-scatter,
    DDP's all-reduce), its tied-embedding parts possibly accumulated in another order:
    ``|Δθ1| <= lr · decoder_gradient_tolerance(...)`` relative to the gradient's largest entry, plus the rounding
    of the two subtractions."""
    from rl_lightning.models.policy import tiny_llama_config
    from tests.tolerances import decoder_gradient_tolerance, unit_roundoff

    initial, fsdp, ddp = runs["initial"], runs["fsdp_sgd"][0]["weights"], runs["ddp_sgd"][0]["weights"]
    scale = max(float((ddp[k] - initial[k]).abs().max()) for k in initial) / SGD_LR  # max |g|
    assert scale > 0
    bound = SGD_LR * float(decoder_gradient_tolerance(tiny_llama_config(64), 64, 16 * 64, scale))
    bound += 2 * unit_roundoff(torch.float32) * max(float(v.abs().max()) for v in initial.values())
    worst = max(float((fsdp[k] - ddp[k]).abs().max()) for k in initial)
    assert worst <= bound, (worst, bound)


def test_fsdp_resume_from_a_step_checkpoint_is_exact(runs):
    straight, resumed = runs["fsdp"][0], runs["resumed"][0]
    assert resumed["step"] == STEPS
    assert all(torch.equal(straight["weights"][k], resumed["weights"][k]) for k in straight["weights"])
