"""TEMPO: macro-step returns from saved environment states, valued by a generative critic on the policy's own
weights ("Test-Time-Scaled Value Estimation with Macro-Step Policy Optimization", Xiaohongshu's dots team;
docs/algorithms.md, TEMPO; no paper or reference code found, the ``KMnO4-zx/agentic-rl-lab`` write-up's settings:
4 branches per state, critic reward ``-|V̂ - G| / R_max`` centred per state, warm-up on complete returns then TD
targets, no prefix importance correction).

Each step continues ``n`` branches (``BranchRollout``, ``data.group_size = n``) from every starting state ``s``: the
step's prompts from their start, and ``replay`` end states of earlier steps' cut branches (``Branch.from_rollout``,
kept in a ``BranchStore``, each within the episode's token budget), for ``horizon`` interactions each:

    G_i = Σ_{h<H} r_{i,h} + V̂(s_{i,H}),    y(s) = (1/n) Σ_i G_i

``V̂`` is the ``GenerativeCritic``'s value of the branch's end state, detached, asked only for branches a limit cut
(a terminated branch's end has value 0 and the critic is not queried there; ``functional.macro_step_returns``).
For the first ``warmup_steps`` steps the branches run to the end of the episode (the strategy's ``max_turns``) and
``G_i`` is the complete (Monte-Carlo) return, no critic queried; then the TD targets above. The actor is GRPO on
``G`` over each state's ``n`` branches (rows of its group); the critic is trained on auxiliary rows in the same
update (``RLModule.auxiliary_rows``): the policy reads ``s`` through the critic's prompt and samples
``critic_samples`` value tokens, each rewarded by ``-|v - y(s)| / (R_max - R_min)`` centred within ``s``'s group, under
GRPO's clipped surrogate (``critic_loss: grpo``: actor and critic both use GRPO, on prompts and rewards of their
own), or the cross-entropy to ``y(s)``'s nearest bin (``critic_loss: ce``). Reused prefixes are off-policy; TEMPO's
importance correction for them is not applied (as in the write-up). The store is per process (each rank keeps its
own). Not validated at scale.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import torch
from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.auxiliary import AuxiliaryRows
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.generative_critic import GenerativeCritic, end_history
from rl_lightning.algorithms.grpo import GRPO
from rl_lightning.functional import branch_mean_targets, group_advantages, macro_step_returns, value_from_grid
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.branching import BRANCH_PREFIX_TOKENS, Branch, BranchRollout, BranchStore
from rl_lightning.rollout.inputs import RolloutInputs

#: ``Advantages.rows`` keys: each row's ``G_i``, its state's ``y(s)``, whether its end was valued, its state replayed
RETURN, TARGET, QUERIED, REPLAYED = "tempo_return", "tempo_target", "critic_queried", "replayed"


class TEMPO(GRPO):
    """GRPO on macro-step returns with a generative critic on the shared policy (see the module docstring).

    Args:
        critic: the ``GenerativeCritic`` (its grid spans its ``value_range``); ``None``: ``GenerativeCritic()``.
        horizon: ``H``, the interactions of a branch after warm-up.
        warmup_steps: steps on complete-episode returns before the TD targets.
        replay: saved end states continued per step besides the step's prompts.
        store_capacity: end states kept (the oldest go).
        critic_loss: ``"grpo"`` (accuracy-rewarded value tokens) or ``"ce"`` (cross-entropy to the nearest bin).
        critic_samples: value tokens sampled per state for ``"grpo"``.
        critic_coef: the critic's term, relative to the actor's.
        critic_scale_rewards: divide the critic's centred rewards by their group's std (whether TEMPO does is not
            published).
        **kwargs: ``GRPO`` arguments (clipping, ``scale_rewards`` of the actor's ``G``, model, optimizer, ...).
    """

    #: not claimed: the contract's check makes a plain rollout, which a ``BranchRollout`` without this method's
    #: branches refuses; rows whose ``G`` has no spread are forwarded (their loss is 0)
    zero_advantage_rows_are_inert = False

    def __init__(self, critic: GenerativeCritic | None = None, horizon: int = 2, warmup_steps: int = 20,
                 replay: int = 8, store_capacity: int = 256, critic_loss: Literal["grpo", "ce"] = "grpo",
                 critic_samples: int = 4, critic_coef: float = 1.0, critic_scale_rewards: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_settings(self, [("horizon", horizon, horizon >= 1, "must be >= 1"),
                              ("warmup_steps", warmup_steps, warmup_steps >= 0, "must be >= 0"),
                              ("replay", replay, replay >= 0, "must be >= 0"),
                              ("critic_loss", critic_loss, critic_loss in ("grpo", "ce"), "must be 'grpo' or 'ce'"),
                              ("critic_samples", critic_samples, critic_samples >= 2, "must be >= 2"),
                              ("critic_coef", critic_coef, critic_coef >= 0, "must be >= 0")])
        self.critic = GenerativeCritic() if critic is None else critic
        self.critic_model = self.critic.attach(self.policy)  # weights="own": the critic's copy (a submodule)
        self.horizon, self.warmup_steps, self.replay = horizon, warmup_steps, replay
        self.critic_loss, self.critic_samples, self.critic_coef = critic_loss, critic_samples, critic_coef
        self.critic_scale_rewards = critic_scale_rewards
        self.store = BranchStore(store_capacity)
        self.episode_tokens: int | None = None  # the strategy's episode budget, read at setup

    @override
    def component_groups(self) -> list[dict[str, Any]]:
        return self.critic.parameter_groups()  # the critic's own weights or adapters, if any

    # ------------------------------------------------------------------ branches
    @override
    def check_datamodule(self, datamodule: Any) -> None:
        super().check_datamodule(datamodule)
        strategy = datamodule.strategy
        if not isinstance(strategy, BranchRollout):
            raise ValueError("TEMPO: data.init_args.strategy must be a rl_lightning.rollout.BranchRollout (it "
                             "continues saved states)")
        if datamodule.async_rollout.queue:
            raise ValueError("TEMPO: data.init_args.async_rollout.queue must be 0 (the store of end states is filled "
                             "by the update and read by the next rollout)")
        self.critic.grid_ids(self.tokenizer)  # refuse a grid the tokenizer cannot encode before anything runs
        self.episode_tokens = strategy.max_episode_tokens

    @override
    def rollout_inputs(self) -> RolloutInputs:
        """Each step's rollouts start from ``branches``."""
        return RolloutInputs(branches=self.branches)

    def warming_up(self, step: int) -> bool:
        return step < self.warmup_steps

    def branches(self, step: int, prompts: Any) -> list[Branch]:
        """The step's prompts from their start, then ``replay`` saved end states (drawn by the step's seed); all
        with the horizon ``H``, or to the episode's end while warming up."""
        turns = None if self.warming_up(step) else self.horizon
        fresh = [Branch(p, prompt_index=i, max_turns=turns) for i, p in zip(prompts.indices, prompts.prompts)]
        saved = [replace(b, max_turns=turns) for b in
                 self.store.sample(self.replay, torch.Generator().manual_seed(self.seed * 1_000_003 + step))]
        return fresh + saved

    def _keep_ends(self, batch: RolloutBatch) -> None:
        for row, end in enumerate(batch.ends.states if batch.ends is not None else []):
            if end is None or end.snapshot_error is not None:
                continue
            room = None if self.episode_tokens is None else self.episode_tokens - len(end.prefix_ids)
            if room is None or room > 0:  # the whole episode stays within the budget
                self.store.add([Branch.from_rollout(batch, row, max_turns=self.horizon, max_tokens=room)])

    # ------------------------------------------------------------------ targets
    @override
    def compute_advantages(self, batch: RolloutBatch) -> Advantages:
        """GRPO advantages of ``G`` over each state's branches, with ``G``, ``y(s)`` and the query flags per row."""
        if batch.ends is None:
            raise ValueError("TEMPO: the batch does not say which branches terminated (make it with a BranchRollout)")
        n, warm = batch.group_size, self.warming_up(self.global_step)
        ends = torch.full((batch.num_rows,), float("nan"), device=batch.rewards.device)
        queried = torch.zeros(batch.num_rows, dtype=torch.bool, device=ends.device) if warm else batch.ends.cut.clone()
        if warm:
            ends = torch.zeros_like(ends)  # Monte-Carlo: a cut complete episode is not bootstrapped
        elif bool(queried.any()):
            rows = queried.nonzero().flatten().tolist()
            contexts = [self.critic.context(self, end_history(batch, r), batch.prompts[r]) for r in rows]
            ends[queried] = self.critic.values(self, contexts).to(ends.dtype)
            self._keep_ends(batch)
        returns = macro_step_returns(batch.rewards, batch.ends.terminated, ends)
        targets = branch_mean_targets(returns, n).repeat_interleave(n)
        replayed = batch.extras[BRANCH_PREFIX_TOKENS].to(ends.device) > 0  # a saved state, not a prompt's start
        rows = {RETURN: returns, TARGET: targets, QUERIED: queried.float(), REPLAYED: replayed.float()}
        return Advantages(group_advantages(returns, n, scale=self.scale_rewards, eps=self.std_eps), rows=rows)

    # ------------------------------------------------------------------ the critic's rows
    @override
    def auxiliary_rows(self, batch: RolloutBatch, adv: Advantages) -> list[AuxiliaryRows] | None:
        """The critic's rows at each starting state ``s`` with target ``y(s)`` (see the module docstring)."""
        if self.critic_coef == 0:
            return None
        starts, contexts = self.critic.start_contexts(self, batch)
        targets = adv.rows[TARGET][starts].float()
        if self.critic_loss == "ce":
            with torch.no_grad():
                values = value_from_grid(self.critic.logprobs(self, contexts), self.critic.levels(self.device))
            rows, reward = self.critic.ce_rows(self, contexts, targets, self.critic_coef), None
        else:
            generator = torch.Generator().manual_seed(self.seed * 1_000_033 + self.global_step)
            rows, stats = self.critic.accuracy_rows(self, contexts, targets, self.critic_samples, generator,
                                                    self.critic_coef, self.clip_eps_high, self.critic_scale_rewards,
                                                    self.std_eps)
            values, reward = stats["critic_value"].to(self.device), stats["critic_reward"]
        stats = {"train/critic_value": [values.mean()],
                 "train/critic_value_std": [values.std(unbiased=False)],  # 0: one value for all
                 "train/critic_error": [(values - targets.to(values.device)).abs().mean()],
                 **({"train/critic_reward": [reward.mean()]} if reward is not None else {})}
        return [replace(rows, metrics={**rows.metrics, **stats})]

    # ------------------------------------------------------------------ metrics and state
    @override
    def before_update(self, batch: RolloutBatch, adv: Advantages, weights: Tensor) -> dict[str, list[Tensor]]:
        rows = adv.rows
        return {**super().before_update(batch, adv, weights), "train/tempo_return": [rows[RETURN].mean()],
                "train/critic_queries": [rows[QUERIED].mean()], "train/replayed_states": [rows[REPLAYED].mean()],
                "train/tempo_warmup": [torch.tensor(float(self.warming_up(self.global_step)))]}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["tempo_store"] = self.store.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.store.load_state_dict(checkpoint["tempo_store"])
