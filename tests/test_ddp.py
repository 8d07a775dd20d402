"""Two CPU processes (gloo): ranks draw different prompts, see the same averaged gradient, end with identical
weights, and that gradient is the one of a single process holding both ranks' rows (the global normaliser).

One 2-process run per method (``tests/helpers/ddp_run.py``); every check reads what that run dumped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO

STEPS = 2


def _run(method: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "helpers" / "ddp_run.py"), str(out), method],
        cwd=out, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


_RUNS: dict[str, Path] = {}


def _ddp(method: str, tmp_path_factory) -> tuple[str, Path]:  # noqa: ANN001
    """``(method, dump directory)`` of one 2-process run, run once and shared by the tests of this module."""
    if method not in _RUNS:
        out = tmp_path_factory.mktemp(f"ddp-{method}")
        _run(method, out)
        _RUNS[method] = out
    return method, _RUNS[method]


@pytest.fixture(scope="module", params=["grpo", "ppo-separate", "grpo-lora"])
def ddp_run(request, tmp_path_factory) -> tuple[str, Path]:
    return _ddp(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def grpo_ddp_run(tmp_path_factory) -> tuple[str, Path]:
    return _ddp("grpo", tmp_path_factory)


def _step(out: Path, step: int, rank: int) -> dict[str, Any]:
    return torch.load(out / f"step{step}_rank{rank}.pt", weights_only=False)


def test_ddp_two_processes_shard_prompts_and_agree_on_weights(ddp_run):
    _, out = ddp_run
    r0 = json.loads((out / "rank0.json").read_text())
    r1 = json.loads((out / "rank1.json").read_text())
    assert r0["world_size"] == r1["world_size"] == 2
    assert len(r0["prompt_index"]) == len(r1["prompt_index"]) == STEPS
    for step, (a, b) in enumerate(zip(r0["prompt_index"], r1["prompt_index"])):
        assert len(a) == len(b) == 2  # prompts_per_step=4 split over 2 ranks
        assert not set(a) & set(b), f"step {step}: ranks drew the same prompts"
        assert sorted(a + b) == list(range(4 * step, 4 * step + 4))  # together: the 1-process stream
    assert r0["params"] == r1["params"]
    assert r0["param_sum"] == r1["param_sum"] and r0["param_abs_sum"] == r1["param_abs_sum"]


def test_ddp_ranks_step_with_the_same_averaged_gradient(ddp_run):
    _, out = ddp_run
    for step in range(STEPS):
        g0, g1 = _step(out, step, 0)["grads"], _step(out, step, 1)["grads"]
        assert g0 and g0.keys() == g1.keys()
        assert max(float(g.abs().max()) for g in g0.values()) > 0, f"step {step}: zero gradient"
        for name in g0:
            assert torch.equal(g0[name], g1[name]), f"step {step}: ranks disagree on the gradient of {name}"


def test_ddp_with_lora_synchronises_the_adapters_only(tmp_path_factory):
    """Under DDP with LoRA adapters only the adapters have gradients (the frozen base takes no part in the
    all-reduce); the two ranks agree on them (the parametrised checks above) at every step."""
    _, out = _ddp("grpo-lora", tmp_path_factory)
    for step in range(STEPS):
        grads = _step(out, step, 0)["grads"]
        assert grads and all(".lora_" in name for name in grads), sorted(grads)[:3]


# ---------------------------------------------------------------------------- one process, whole batch
def _concat(records: list[dict[str, Any]], pad_id: int):
    """One ``RolloutBatch`` of every rank's rows: prompts re-left-padded, responses re-right-padded."""
    from rl_lightning.rollout.batch import RolloutBatch

    widths = [r["input_ids"].shape[1] for r in records]
    p_max = max(r["prompt_length"] for r in records)
    t_max = max(w - r["prompt_length"] for w, r in zip(widths, records))
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("input_ids", "attention_mask", "loss_mask",
                                                            "sampler_logprobs")}
    for width, r in zip(widths, records):
        n, p, t = r["input_ids"].shape[0], r["prompt_length"], width - r["prompt_length"]
        ids = torch.full((n, p_max + t_max), pad_id, dtype=r["input_ids"].dtype)
        att = torch.zeros((n, p_max + t_max), dtype=r["attention_mask"].dtype)
        ids[:, p_max - p:p_max + t] = r["input_ids"]
        att[:, p_max - p:p_max + t] = r["attention_mask"]
        parts["input_ids"].append(ids)
        parts["attention_mask"].append(att)
        for name in ("loss_mask", "sampler_logprobs"):
            padded = torch.zeros((n, t_max), dtype=r[name].dtype)
            padded[:, :t] = r[name]
            parts[name].append(padded)
    assert len({r["group_size"] for r in records}) == 1
    return RolloutBatch(
        **{k: torch.cat(v) for k, v in parts.items()},
        prompt_length=p_max,
        rewards=torch.cat([r["rewards"] for r in records]),
        group_size=records[0]["group_size"],
        prompt_index=torch.cat([r["prompt_index"] for r in records]),
        truncated=torch.cat([r["truncated"] for r in records]),
        temperature=records[0]["temperature"],
        top_p=records[0]["top_p"],
    )


def _single_process_step(state: dict[str, torch.Tensor], batch, aggregation: str):
    """``(loss, {name: grad})`` of GRPO's update on ``batch`` in one process (no trainer: world size 1)."""
    from rl_lightning.algorithms import GRPO, Advantages

    module = GRPO(model_name_or_path="embedded:arithmetic", loss_aggregation=aggregation, max_grad_norm=None)
    module.policy.load_state_dict(state)
    module.policy.train()
    advantages = Advantages(module.compute_advantages(batch).detach().unsqueeze(-1))
    weights = module.loss_weights(batch)
    loss, _ = module.policy_loss(batch, module.forward_policy(batch), advantages, weights)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> float:
    """Two computations of one gradient from the same per-row contributions, in other shapes (a rank's rows
    against the whole batch) and summed in another order (DDP's all-reduce): ``decoder_gradient_tolerance`` of
    ``max |g|`` (the embedded decoder, 16 rows of at most its 64 positions; 3.8e-5 of max|g|)."""
    from rl_lightning.models.policy import tiny_llama_config
    from tests.tolerances import decoder_gradient_tolerance

    assert got.keys() == want.keys()
    scale = max(float(g.abs().max()) for g in want.values())
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    bound = float(decoder_gradient_tolerance(tiny_llama_config(64), 64, 16 * 64, scale))
    assert worst <= bound, f"{what}: max |Δgrad| {worst:.3e} vs max |grad| {scale:.3e}"
    return worst


def _metric_tolerances(state: dict[str, torch.Tensor], batch, aggregation: str) -> dict:
    """``test_skipping._metric_tolerances`` of GRPO at ``state`` on ``batch``: the logged metrics of other shapes,
    relative to the size of their terms (the loss cancels)."""
    from rl_lightning.algorithms import GRPO
    from tests.algorithms.test_skipping import _metric_tolerances as tolerances

    module = GRPO(model_name_or_path="embedded:arithmetic", loss_aggregation=aggregation, max_grad_norm=None)
    module.policy.load_state_dict(state)
    module.policy.train()
    return tolerances(module, batch)


def test_ddp_gradient_equals_one_process_holding_the_whole_batch(grpo_ddp_run):
    method, out = grpo_ddp_run
    from rl_lightning.algorithms import GRPO
    from rl_lightning.models.policy import load_policy
    from tests.helpers.ddp_run import GRPO_AGGREGATION

    pad_id = load_policy("embedded:arithmetic")[1].pad_token_id
    for step, aggregation in enumerate(GRPO_AGGREGATION):
        ranks = [_step(out, step, rank) for rank in (0, 1)]
        assert [r["aggregation"] for r in ranks] == [aggregation] * 2
        records = [r["batch"] for r in ranks]
        tokens = [float(r["loss_mask"].sum()) for r in records]
        if aggregation == "token_mean":  # else a per-rank token count would give the same normaliser
            assert tokens[0] != tokens[1], f"step {step}: both ranks generated {tokens[0]} tokens"
        batch = _concat(records, pad_id)

        # groups never straddle ranks, so the whole batch's advantages are the ranks' advantages side by side
        module = GRPO(model_name_or_path="embedded:arithmetic")
        per_rank = torch.cat([module.compute_advantages(_concat([r], pad_id)) for r in records])
        assert torch.equal(module.compute_advantages(batch), per_rank)
        assert per_rank.abs().max() > 0, f"step {step}: every advantage is zero; the comparison would be vacuous"

        loss, grads = _single_process_step(ranks[0]["state"], batch, aggregation)
        _assert_grads_close(ranks[0]["grads"], grads, f"step {step} ({aggregation})")
        # the logged loss is the ranks' mean of their (globally normalised, x world size) losses: the global one
        absolute, _ = _metric_tolerances(ranks[0]["state"], batch, aggregation)["train/loss"]
        assert abs(ranks[0]["logged_loss"] - float(loss)) <= absolute

        if aggregation == "token_mean":  # the check has teeth: per-rank normalisers give another gradient
            local = [_single_process_step(ranks[0]["state"], _concat([r], pad_id), aggregation)[1] for r in records]
            wrong = {n: (local[0][n] + local[1][n]) / 2 for n in grads}
            with pytest.raises(AssertionError):
                _assert_grads_close(wrong, grads, "per-rank normaliser")


def test_ddp_token_metrics_are_means_over_all_ranks_tokens(grpo_ddp_run):
    """``train/entropy`` is the mean over both ranks' tokens, not the mean of the two per-rank means (the tokens
    of the rows the update forwards: rows with zero advantage are skipped, ``skip_inert_rows``)."""
    _, out = grpo_ddp_run
    from rl_lightning.algorithms import GRPO
    from rl_lightning.models.policy import load_policy

    pad_id = load_policy("embedded:arithmetic")[1].pad_token_id
    module = GRPO(model_name_or_path="embedded:arithmetic")
    step = 1  # the step whose ranks generated different token counts (checked above)
    ranks = [_step(out, step, rank) for rank in (0, 1)]
    module.policy.load_state_dict(ranks[0]["state"])
    module.policy.train()

    def entropy_sum_and_tokens(batch):
        with torch.no_grad():
            ent = module.forward_policy(batch, with_entropy=True).entropy
        live = (module.compute_advantages(batch) != 0).float().unsqueeze(-1)  # the rows update forwards
        assert live.any()
        return float((ent * live).sum()), float((batch.loss_mask * live).sum())

    parts = [entropy_sum_and_tokens(_concat([r["batch"]], pad_id)) for r in ranks]
    assert parts[0][1] != parts[1][1]
    global_mean = (parts[0][0] + parts[1][0]) / (parts[0][1] + parts[1][1])
    mean_of_means = (parts[0][0] / parts[0][1] + parts[1][0] / parts[1][1]) / 2
    assert ranks[0]["logged_entropy"] == ranks[1]["logged_entropy"]
    whole = _concat([r["batch"] for r in ranks], pad_id)
    tol, _ = _metric_tolerances(ranks[0]["state"], whole, "seq_mean_token_mean")["train/entropy"]
    assert abs(ranks[0]["logged_entropy"] - global_mean) <= tol
    assert abs(global_mean - mean_of_means) > 2 * tol  # the two readings really differ here


def test_ddp_ranks_that_skip_different_rows_agree_and_give_the_one_process_gradient(tmp_path_factory):
    """Rank 0 skips every row (constant rewards), rank 1 forwards up to 4 micro-batches: rank 0 makes up the
    backward passes with zero-contribution rows (no deadlock), and the averaged gradient is the one of a single
    process forwarding every row of both ranks."""
    _, out = _ddp("grpo-skip", tmp_path_factory)
    from rl_lightning.models.policy import load_policy

    pad_id = load_policy("embedded:arithmetic")[1].pad_token_id
    for step in range(STEPS):
        ranks = [_step(out, step, rank) for rank in (0, 1)]
        assert torch.equal(ranks[0]["batch"]["rewards"], torch.full((8,), 0.5))
        g0, g1 = ranks[0]["grads"], ranks[1]["grads"]
        for name in g0:
            assert torch.equal(g0[name], g1[name]), f"step {step}: ranks disagree on the gradient of {name}"
        skipped = ranks[0]["logged_skipped_rows"]
        assert ranks[1]["logged_skipped_rows"] == skipped and 0.5 <= skipped < 1.0  # rank 0: all; rank 1: some
        batch = _concat([r["batch"] for r in ranks], pad_id)
        _, grads = _single_process_step(ranks[0]["state"], batch, "seq_mean_token_mean")
        _assert_grads_close(g0, grads, f"step {step} (skipping)")


def test_ddp_dynamic_sampling_keeps_the_ranks_in_step_with_equal_rows(tmp_path_factory):
    """Rank 0 never gets an accepted group, so every step draws all 3 rounds on both ranks (the ranks agree on
    the rounds: no deadlock); each rank trains on its 2 x 4 rows (rank 0 topped up with rejected groups), from
    the stream's draws d, d + 1, d + 2 of that step (global prompts 4d .. 4d + 3, rank r's slice 4d + 2r, +1)."""
    _, out = _ddp("grpo-dynamic", tmp_path_factory)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["metrics"]["train/sampling_rounds"] == 3.0
    assert ranks[0]["extra_draws"] == ranks[1]["extra_draws"] == 2 * STEPS
    assert ranks[0]["prompt_index"] == [[0, 1], [12, 13]]  # all rejected: the first round's groups
    for step in range(STEPS):
        rows = [_step(out, step, r)["batch"]["rewards"].numel() for r in (0, 1)]
        assert rows == [8, 8]
        drawn = {4 * d + 2 + k for d in range(3 * step, 3 * step + 3) for k in (0, 1)}
        assert set(ranks[1]["prompt_index"][step]) <= drawn


def test_ddp_dynamic_sampling_on_multi_turn_episodes_keeps_the_ranks_in_step(tmp_path_factory):
    """Guess-the-number, up to 5 turns, where rank 0's filter keeps no group: both ranks draw all 3 rounds of
    every step (no deadlock), train on 2 x 4 rows each and end with the same weights; the joined rows keep their
    turn fields (each generated token's turn below the row's turn count, the prompt and observations at -1, the
    turn rewards summing to the row's reward)."""
    _, out = _ddp("grpo-dynamic-turns", tmp_path_factory)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["metrics"]["train/sampling_rounds"] == ranks[1]["metrics"]["train/sampling_rounds"] == 3.0
    assert ranks[0]["extra_draws"] == ranks[1]["extra_draws"] == 2 * STEPS
    for step in range(STEPS):
        for rank in (0, 1):
            batch = _step(out, step, rank)["batch"]
            assert batch["rewards"].numel() == 8
            assert "turns.count" in batch and int(batch["turns.count"].max()) > 1  # episodes, not single turns
            for row in range(8):
                generated = batch["turns.index"][row][batch["loss_mask"][row].bool()]
                assert int(generated.max()) + 1 == int(batch["turns.count"][row])
                assert bool((batch["turns.index"][row][~batch["loss_mask"][row].bool()] == -1).all())
            assert torch.allclose(torch.nan_to_num(batch["turns.rewards"]).sum(dim=1), batch["rewards"])


def test_spo_tracker_is_the_same_on_every_rank_and_holds_every_ranks_prompts(tmp_path_factory):
    """Each rank gathers all ranks' outcomes and applies them in rank order: one tracker, everywhere."""
    _, out = _ddp("spo", tmp_path_factory)
    r0 = json.loads((out / "rank0.json").read_text())
    r1 = json.loads((out / "rank1.json").read_text())
    assert r0["tracker"] == r1["tracker"] and r0["params"] == r1["params"]
    seen = [uid for record in (r0, r1) for step in record["prompt_ids"] for uid in step]
    assert len(seen) == 3 * 4  # 3 steps x 4 prompts over the two ranks
    assert {uid for uid, _, _ in r0["tracker"]} == set(seen)
    assert len(set(seen)) < len(seen)  # prompts came back (a pool of 6), possibly on the other rank
    for uid, alpha, beta in r0["tracker"]:
        visits = seen.count(uid)
        # N = alpha + beta starts at 1 and becomes rho N + 1 per visit with rho in [0.875, 0.96]
        low, high = 1.0, 1.0
        for _ in range(visits):
            low, high = 0.875 * low + 1, 0.96 * high + 1
        assert low - 1e-9 <= alpha + beta <= high + 1e-9, (uid, visits, alpha + beta)


def test_ddp_auxiliary_rows_pad_to_equal_backwards_and_join_the_one_process_gradient(tmp_path_factory):
    """Rank 0 gives 1 auxiliary row, rank 1 three (micro-batches of one row): rank 0 repeats its row with weight 0
    (no deadlock), and the averaged gradient is one process's gradient of both ranks' rollout rows plus the
    auxiliary term over all four rows. A callback's ``add_step_metrics`` value is averaged over the ranks."""
    from rl_lightning.algorithms import GRPO
    from rl_lightning.models.policy import load_policy
    from tests.helpers.ddp_run import AUX_COEF, AUX_ROWS

    _, out = _ddp("grpo-aux", tmp_path_factory)
    pad_id = load_policy("embedded:arithmetic")[1].pad_token_id
    for step in range(STEPS):
        ranks = [_step(out, step, rank) for rank in (0, 1)]
        g0, g1 = ranks[0]["grads"], ranks[1]["grads"]
        for name in g0:
            assert torch.equal(g0[name], g1[name]), f"step {step}: ranks disagree on the gradient of {name}"
        _, grads = _single_process_step(ranks[0]["state"], _concat([r["batch"] for r in ranks], pad_id),
                                        "seq_mean_token_mean")
        module = GRPO(model_name_or_path="embedded:arithmetic")
        module.policy.load_state_dict(ranks[0]["state"])
        rows = [row for rank in AUX_ROWS for row in rank]
        logp = torch.cat([module.candidate_logprobs([c], [t]) for c, t in rows])  # one row at a time
        (AUX_COEF * -logp.mean()).backward()
        for n, p in module.named_parameters():
            grads[n] = grads[n] + p.grad
        _assert_grads_close(g0, grads, f"step {step} (auxiliary rows)")
    for rank in (0, 1):
        assert json.loads((out / f"rank_value{rank}.json").read_text()) == 0.5


@pytest.mark.parametrize("method", ["tempo", "ac2"])
def test_ddp_branching_methods_keep_the_ranks_in_step(method, tmp_path_factory):
    """TEMPO past its warm-up (each rank replays its own saved states and asks its critic at cut ends) and AC2
    (completions of unready chunks, FullRolloutAudit on every candidate) on 2 processes: every step completes on
    both ranks (the collectives match) and the ranks end with the same weights."""
    _, out = _ddp(method, tmp_path_factory)
    r0 = json.loads((out / "rank0.json").read_text())
    r1 = json.loads((out / "rank1.json").read_text())
    assert r0["world_size"] == r1["world_size"] == 2
    assert len(r0["loss"]) == len(r1["loss"]) == 4 and r0["loss"] == r1["loss"]  # logged: averaged over ranks
    assert r0["params"] == r1["params"] and r0["param_sum"] == r1["param_sum"]
    if method == "tempo":  # the last step is in the TD phase, with saved states
        assert r0["metrics"]["train/tempo_warmup"] == 0.0 and r0["metrics"]["train/replayed_states"] > 0
    else:
        assert r0["metrics"]["train/completed"] > 0


def test_ddp_evaluation_gathers_every_items_outcome_in_heldout_order(tmp_path_factory):
    """Each held-out item's reward comes from the rank that evaluated it (8 + 7 items, in batches of 4), the file
    lists all 15 in held-out order, their mean is the logged val/reward, and before any update they are the
    outcomes of one process evaluating the same warm start."""
    import csv

    from rl_lightning.algorithms import GRPO
    from rl_lightning.envs import ArithmeticTask
    from tests.conftest import tiny_datamodule, tiny_trainer

    _, out = _ddp("grpo-eval", tmp_path_factory)
    items: dict[int, list[tuple[int, float]]] = {}
    with open(out / "run" / "version_0" / "eval_items.csv", newline="") as f:
        for row in csv.DictReader(f):
            items.setdefault(int(row["step"]), []).append((int(row["item"]), float(row["reward"])))
    logged: dict[int, float] = {}
    with open(out / "run" / "version_0" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("val/reward"):
                logged[int(row["step"])] = float(row["val/reward"])
    assert sorted(items) == sorted(logged) == [0, 1, 2]
    for step, rows in items.items():
        assert [i for i, _ in rows] == list(range(15)) and all(r in (0.0, 1.0) for _, r in rows)
        assert sum(r for _, r in rows) / 15 == pytest.approx(logged[step], abs=1e-6)  # k/15 in float32: 1 ulp
    module = GRPO(model_name_or_path="embedded:arithmetic")
    data = tiny_datamodule(prompts_per_step=4, task=ArithmeticTask(num_heldout=15), batch_size=4)
    tiny_trainer(tmp_path_factory.mktemp("one"), max_steps=0).fit(module, datamodule=data)
    got: dict[int, float] = {}
    data.evaluate(on_batch=lambda b: got.update(zip(b.prompt_index.tolist(), b.rewards.tolist())))
    assert [got[i] for i in range(15)] == [r for _, r in items[0]]
