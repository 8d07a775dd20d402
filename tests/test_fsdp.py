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
LR, STEPS = 1e-4, 2  # GRPO's default AdamW learning rate; the runs' steps


def _run(out: Path, kind: str, steps: int, resume: Path | None = None) -> list[dict]:
    args = [sys.executable, str(REPO / "tests" / "helpers" / "fsdp_run.py"), str(out), kind, str(steps)]
    proc = subprocess.run(args + ([str(resume)] if resume else []), cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("fsdp")
    fsdp = _run(root / "fsdp", "fsdp", STEPS)
    first = sorted((root / "fsdp" / "ckpt").glob("*step=1.ckpt"))
    assert first, "no step-1 checkpoint"
    return {"fsdp": fsdp, "ddp": _run(root / "ddp", "ddp", STEPS),
            "resumed": _run(root / "resumed", "fsdp", STEPS, resume=first[0])}


def test_fsdp_trains_and_its_ranks_hold_the_same_full_weights(runs):
    a, b = runs["fsdp"]
    assert a["step"] == b["step"] == STEPS
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def test_fsdp_clips_on_the_global_gradient_norm(runs):
    """The logged norm is the norm of the whole gradient, as under DDP (whose ranks hold all of it): the same
    gradient summed in another order (shard by shard, then over ranks), so equal within the rounding of a sum of
    ``D`` squares (a norm of one rank's shard alone would be about ``1/sqrt(2)`` of it)."""
    fsdp, ddp = runs["fsdp"][0]["grad_norms"], runs["ddp"][0]["grad_norms"]
    params = sum(v.numel() for v in runs["fsdp"][0]["weights"].values())
    assert len(fsdp) == len(ddp) == STEPS and all(n > 0.05 for n in ddp)  # the clip (0.05) acts at every step
    for got, want in zip(fsdp, ddp):
        assert abs(got - want) <= 2 * gamma_probabilistic(params) * want


def test_fsdp_weights_agree_with_ddp(runs):
    """Each AdamW step moves a weight by at most about ``lr`` whatever the gradient's scale, and the two runs'
    gradients differ only by the clip coefficient's rounding (relative ``ε``, see above), which moves an Adam step
    by ``<= lr · ε`` per coordinate: the weights agree within ``STEPS · lr · 2ε``."""
    fsdp, ddp = runs["fsdp"][0]["weights"], runs["ddp"][0]["weights"]
    params = sum(v.numel() for v in fsdp.values())
    bound = STEPS * LR * 2 * 2 * gamma_probabilistic(params)
    worst = max(float((fsdp[k] - ddp[k]).abs().max()) for k in fsdp)
    assert worst <= bound, (worst, bound)


def test_fsdp_resume_from_a_step_checkpoint_is_exact(runs):
    straight, resumed = runs["fsdp"][0], runs["resumed"][0]
    assert resumed["step"] == STEPS
    assert all(torch.equal(straight["weights"][k], resumed["weights"][k]) for k in straight["weights"])
