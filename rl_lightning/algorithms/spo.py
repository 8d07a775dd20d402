"""SPO, Single-stream Policy Optimization (Xu & Ding 2025, arXiv 2509.13232; reference code
``verl-project/verl-recipe`` ``spo/``; docs/algorithms.md, SPO).

One response per prompt; its baseline is a persistent per-prompt Beta tracker instead of a group mean:
``A = R - v̂_old(x)``, normalised over the (global) batch, then GRPO's clipped loss. After the update each
visited prompt's tracker takes the outcome with the discount ``ρ = clamp(2^(-D/D_half), ρ_min, ρ_max)``, ``D``
the token-mean ``|Δ log π|`` on the prompt's previous response (``functional.tracker``). Prompts are drawn with
probability ∝ ``sqrt(v̂(1 - v̂)) + ε`` through a ``WeightedSampler`` that reads the tracker at draw time.

The tracker is keyed by ``Prompt.uid``, kept identical on every rank (each rank gathers all ranks' outcomes
and applies them in rank order) and saved in checkpoints.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import torch
from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.grpo import GRPO
from rl_lightning.envs.base import Prompt
from rl_lightning.functional import (
    beta_tracker_update, normalized_advantages, spo_discount, tracker_sampling_weights, tracker_value,
)
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.inputs import RolloutInputs
from rl_lightning.rollout.prompts import WeightedSampler

#: a prompt's last response: (context ids, response ids, response loss mask, log-probs after that step's update)
StoredResponse = tuple[list[int], list[int], list[int], list[float]]


class SPO(GRPO):
    """GRPO's loss on single-stream advantages from a per-prompt Bayesian value tracker.

    Args:
        discount: ``divergence`` -- ρ from the policy's change on the prompt's last response (the reference
            code's ``kl`` mode); ``constant`` -- ``ρ = rho_max`` always.
        rho_min, rho_max: the clamp of ρ (reference: 0.875 and 0.96; ``rho_max = 1`` keeps all evidence).
        half_life: ``D_half`` of ``ρ = 2^(-D/D_half)`` (reference: 0.06).
        prior_alpha, prior_beta: the tracker of a prompt never seen (reference without offline values: 0.5, 0.5).
        explore: ε of the sampling weights ``sqrt(v̂(1 - v̂)) + ε``.
        prioritized: draw prompts by those weights; needs ``data.init_args.prompt_sampler`` to be a
            ``WeightedSampler`` (its pool is the dataset the tracker learns about).
        adv_eps: added to the batch std of the advantages.
        baseline: ``tracker`` -- ``A = R - v̂_old(x)`` (SPO); ``batch_mean`` -- ``A = R`` before the batch
            normalisation, i.e. the batch mean as the baseline: the ablation of the tracker, which still learns
            and still weights the prompt draws.
        **kwargs: ``GRPO`` arguments (clipping, aggregation, optimiser, ...).
    """

    min_group_size = 1

    def __init__(
        self, discount: Literal["divergence", "constant"] = "divergence", rho_min: float = 0.875,
        rho_max: float = 0.96, half_life: float = 0.06, prior_alpha: float = 0.5, prior_beta: float = 0.5,
        explore: float = 0.05, prioritized: bool = True, adv_eps: float = 1e-8,
        baseline: Literal["tracker", "batch_mean"] = "tracker", **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        spo_discount(torch.zeros(1), half_life, rho_min, rho_max)  # validates the three
        check_settings(self, [("prior_alpha", prior_alpha, prior_alpha > 0, "must be > 0"),
                              ("prior_beta", prior_beta, prior_beta > 0, "must be > 0"),
                              ("explore", explore, explore >= 0, "must be >= 0"),
                              ("baseline", baseline, baseline in ("tracker", "batch_mean"),
                               "must be 'tracker' or 'batch_mean'")])
        self.discount, self.rho_min, self.rho_max, self.half_life = discount, rho_min, rho_max, half_life
        self.prior = (float(prior_alpha), float(prior_beta))
        self.explore, self.prioritized, self.adv_eps, self.baseline = explore, prioritized, adv_eps, baseline
        self.tracker: dict[int, tuple[float, float]] = {}  # Prompt.uid -> (α, β)
        self.last_response: dict[int, StoredResponse] = {}

    @override
    def check_datamodule(self, datamodule: Any) -> None:
        super().check_datamodule(datamodule)
        if not self.prioritized:
            return
        sampler = getattr(datamodule, "prompt_sampler", None)
        if not isinstance(sampler, WeightedSampler):
            raise ValueError(
                f"SPO(prioritized=true) draws prompts from its tracker: set data.init_args.prompt_sampler to "
                f"{{class_path: rl_lightning.rollout.WeightedSampler, init_args: {{pool_size: ...}}}} (got "
                f"{type(sampler).__name__}), or model.init_args.prioritized: false")

    @override
    def rollout_inputs(self) -> RolloutInputs:
        """The data module's ``WeightedSampler`` draws prompts by ``prompt_weights`` when ``prioritized``."""
        return RolloutInputs(prompt_weights=self.prompt_weights if self.prioritized else None)

    def values(self, uids: Sequence[int]) -> Tensor:
        """``v̂`` of each prompt (float64; the prior's for prompts never seen)."""
        pairs = torch.tensor([self.tracker.get(int(u), self.prior) for u in uids], dtype=torch.float64)
        return tracker_value(pairs[:, 0], pairs[:, 1]) if len(pairs) else pairs.new_zeros(0)

    def prompt_weights(self, prompts: Sequence[Prompt]) -> Tensor:
        """The sampling weight of each prompt, read by the ``WeightedSampler`` when a step's prompts are drawn."""
        return tracker_sampling_weights(self.values([p.uid for p in prompts]), self.explore)

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        if batch.prompt_id is None:
            raise ValueError("SPO needs RolloutBatch.prompt_id (stable prompt ids) for its tracker")
        rewards = batch.rewards.double()
        if bool(((rewards < 0) | (rewards > 1)).any()):
            raise ValueError(f"SPO's Beta tracker needs rewards in [0, 1], got a batch with min {float(rewards.min())}"
                             f" and max {float(rewards.max())} (data.init_args.reward_fn)")
        raw = rewards  # baseline batch_mean: the normalisation below subtracts the batch mean
        if self.baseline == "tracker":
            raw = rewards - self.values(batch.prompt_id.tolist()).to(rewards.device)  # before this step's outcomes
        sums = torch.stack([raw.sum(), (raw * raw).sum(), raw.new_tensor(float(raw.numel()))])
        sums = self.ranks.sum(sums)
        count = float(sums[2])
        mean = sums[0] / count
        std = ((sums[1] - count * mean * mean).clamp(min=0) / (count - 1)).sqrt() if count > 1 else mean.new_zeros(())
        return normalized_advantages(raw, mean, std, self.adv_eps).to(batch.rewards.dtype)

    @override
    def after_update(self, batch: RolloutBatch, adv: Advantages) -> dict[str, list[Tensor]]:
        return self.update_tracker(batch)

    @staticmethod
    def _stored_rows(batch: RolloutBatch) -> list[tuple[list[int], list[int], list[int]]]:
        """Each row's (context ids, response ids up to its last real token, loss mask of those ids)."""
        rows = []
        prompt, response = batch.input_ids[:, :batch.prompt_length], batch.response_ids
        attention = batch.attention_mask[:, batch.prompt_length:]
        for i in range(batch.num_rows):
            real = int(attention[i].nonzero().max()) + 1 if bool(attention[i].any()) else 0
            context = prompt[i][batch.attention_mask[i, :batch.prompt_length].bool()].tolist()
            rows.append((context, response[i, :real].tolist(), batch.loss_mask[i, :real].tolist()))
        return rows

    def _score(self, rows: Sequence[tuple[list[int], list[int], list[int]]], temperature: float) -> list[list[float]]:
        """Log-probs of each row's response ids under the current policy (0 off its mask)."""
        if not rows:
            return []
        out, _ = self.score_sequences([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                                      temperature=temperature)
        return [out.logprobs[i, :len(r[1])].tolist() for i, r in enumerate(rows)]

    @torch.no_grad()
    def update_tracker(self, batch: RolloutBatch) -> dict[str, list[Tensor]]:
        """Fold this step's outcomes into the tracker, after the policy update (so ``D`` sees the new policy).

        Returns the step's tracker metrics (the same on every rank): mean ``ρ``, mean ``D`` over revisited
        prompts, the fraction of rows whose prompt was seen before, and the number of prompts tracked.
        """
        rows = self._stored_rows(batch)
        uids = [int(u) for u in batch.prompt_id.tolist()]
        revisit = [i for i, u in enumerate(uids) if u in self.last_response]
        old = [self.last_response[uids[i]] for i in revisit]
        divergence = [0.0] * len(rows)
        if self.discount == "divergence" and old:
            for i, entry, now in zip(revisit, old, self._score([e[:3] for e in old], batch.temperature)):
                mask = torch.tensor(entry[2], dtype=torch.float64)
                diff = (torch.tensor(entry[3], dtype=torch.float64) - torch.tensor(now, dtype=torch.float64)).abs()
                divergence[i] = float((diff * mask).sum() / mask.sum().clamp(min=1.0))
        scored = self._score(rows, batch.temperature)
        mine = [(u, float(r), d, (*row, lp)) for u, r, d, row, lp in
                zip(uids, batch.rewards.tolist(), divergence, rows, scored)]
        records = [rec for rank_records in self.ranks.gather_objects(mine) for rec in rank_records]
        rhos, seen = [], []
        for uid, reward, d, stored in records:  # in rank order: the same state on every rank
            seen.append(uid in self.tracker)
            rho = float(spo_discount(torch.tensor(d, dtype=torch.float64), self.half_life, self.rho_min, self.rho_max))
            if self.discount == "constant":
                rho = self.rho_max
            alpha, beta = beta_tracker_update(*(torch.tensor(v, dtype=torch.float64)
                                                for v in self.tracker.get(uid, self.prior)), reward, rho)
            self.tracker[uid] = (float(alpha), float(beta))
            self.last_response[uid] = stored
            rhos.append(rho)
        revisited = [rec[2] for rec, was in zip(records, seen) if was]
        return {
            "train/spo_rho": [torch.tensor(sum(rhos) / max(len(rhos), 1))],
            "train/spo_divergence": [torch.tensor(sum(revisited) / max(len(revisited), 1))],
            "train/spo_revisit_fraction": [torch.tensor(sum(seen) / max(len(seen), 1))],
            "train/spo_tracked_prompts": [torch.tensor(float(len(self.tracker)))],
        }

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["spo_tracker"] = {"tracker": dict(self.tracker), "last_response": dict(self.last_response)}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("spo_tracker", {})
        self.tracker = {int(k): (float(a), float(b)) for k, (a, b) in state.get("tracker", {}).items()}
        self.last_response = {int(k): tuple(v) for k, v in state.get("last_response", {}).items()}
