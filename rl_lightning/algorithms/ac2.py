"""AC2: short continuations of replayed response prefixes, valued by a value-token critic once it is trusted (no
paper or reference code found: docs/algorithms.md, AC2).

Each step continues ``G`` chunks (``BranchRollout``, ``data.group_size = G``) of ``chunk_tokens`` sampled tokens from
every prefix ``s``: the step's prompts with an empty prefix, and ``replay`` prefixes that earlier steps' chunks left
unfinished (``Branch.from_rollout``: the pending response ids, kept in a ``BranchStore``). A chunk's value is

    v_i = R_i                 if the chunk completed the response (it terminated: the verifier scored it),
    v_i = V_θ(s · c_i)        if it is unfinished and the problem is ready (``readiness.CriticReadiness``),
    v_i = R of a completion   if it is unfinished and the problem is not ready yet

with ``V_θ`` the ``GenerativeCritic`` on the policy's weights (the prompt, the response so far, ``" V:"``, a value
token). ``Â_i = v_i - v̄`` over the prefix's ``G`` chunks (``Σ_i Â_i = 0``) is shared by the chunk's tokens; the prefix
is context (the prompt part of the row), so replayed prefix tokens get no actor loss. The loss is GRPO's clipped
surrogate. The critic learns, in the same update (auxiliary rows), the cross-entropy of the value token of ``v̄``'s
nearest bin at ``s`` (the group mean rounded to the grid; self-bootstrapped where ``v`` mixes predictions).

The readiness check (AC2's is not published): a problem (``Prompt.uid``) is ready when the critic's last ``window``
audits on it all had ``|V̂ - R| < threshold``. Audits come from two places: every completion of an unready problem's
unfinished chunk (its critic value is asked too, so each completion is also an audit), and the
``FullRolloutAudit`` callback, which completes a fraction of the ready problems' valued chunks after the update
(``audit_candidates`` / ``record_audits``: the ``AuditedCritic`` protocol), so a problem whose critic drifts loses
its readiness. The store and the readiness are per process and checkpointed. Not validated at scale.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.auxiliary import AuxiliaryRows
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.generative_critic import GenerativeCritic, end_history
from rl_lightning.algorithms.grpo import GRPO
from rl_lightning.algorithms.readiness import AuditItem, CriticReadiness
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.branching import Branch, BranchRollout, BranchStore
from rl_lightning.rollout.inputs import RolloutInputs

#: ``Advantages.rows`` keys: each row's value ``v_i``, its prefix's ``v̄``, whether the critic valued it / a
#: completion did
VALUE, TARGET, CRITIC_VALUED, COMPLETED = "chunk_value", "chunk_target", "critic_valued", "completed"


class AC2(GRPO):
    """Chunk continuations with a value-token critic and a readiness check (see the module docstring).

    Args:
        critic: the ``GenerativeCritic`` (``None``: ``GenerativeCritic()``, 11 bins on [0, 1]); its ``weights``
            (``shared``, ``own``, ``adapter``) say what it reads and trains, as in TEMPO.
        chunk_tokens: sampled tokens per chunk (the branches' token budget).
        replay: unfinished prefixes continued per step besides the step's prompts.
        store_capacity: prefixes kept (the oldest go).
        readiness_threshold, readiness_window: ``τ`` and ``k`` of ``CriticReadiness``.
        critic_coef: the critic's cross-entropy term, relative to the actor's.
        **kwargs: ``GRPO`` arguments (clipping, model, optimizer, ...); the advantages are not std-scaled.
    """

    #: not claimed, as TEMPO: the contract's plain rollout cannot run a BranchRollout without this method's branches
    zero_advantage_rows_are_inert = False

    def __init__(self, critic: GenerativeCritic | None = None, chunk_tokens: int = 2, replay: int = 8,
                 store_capacity: int = 256, readiness_threshold: float = 0.2, readiness_window: int = 3,
                 critic_coef: float = 1.0, **kwargs: Any) -> None:
        super().__init__(scale_rewards=False, **kwargs)
        check_settings(self, [("chunk_tokens", chunk_tokens, chunk_tokens >= 1, "must be >= 1"),
                              ("replay", replay, replay >= 0, "must be >= 0"),
                              ("critic_coef", critic_coef, critic_coef >= 0, "must be >= 0")])
        self.critic = GenerativeCritic() if critic is None else critic
        self.critic_model = self.critic.attach(self.policy)  # weights="own": the critic's copy (a submodule)
        self.chunk_tokens, self.replay, self.critic_coef = chunk_tokens, replay, critic_coef
        self.readiness = CriticReadiness(readiness_threshold, readiness_window)
        self.store = BranchStore(store_capacity)
        self.max_new_tokens: int | None = None
        self._audit: list[AuditItem] = []

    @override
    def component_groups(self) -> list[dict[str, Any]]:
        return self.critic.parameter_groups()  # the critic's own weights or adapters, if any

    @override
    def check_datamodule(self, datamodule: Any) -> None:
        super().check_datamodule(datamodule)
        if not isinstance(datamodule.strategy, BranchRollout):
            raise ValueError("AC2: data.init_args.strategy must be a rl_lightning.rollout.BranchRollout (it continues "
                             "replayed prefixes)")
        if datamodule.async_rollout.queue:
            raise ValueError("AC2: data.init_args.async_rollout.queue must be 0 (the update fills the store the "
                             "rollout reads)")
        self.critic.grid_ids(self.tokenizer)
        self.max_new_tokens = int(datamodule.sampling.max_new_tokens)

    @override
    def rollout_inputs(self) -> RolloutInputs:
        """Each step's rollouts start from ``branches``."""
        return RolloutInputs(branches=self.branches)

    def branches(self, step: int, prompts: Any) -> list[Branch]:
        """The step's prompts (empty prefix), then ``replay`` stored prefixes; a chunk's budget each."""
        fresh = [Branch(p, prompt_index=i, max_tokens=self.chunk_tokens)
                 for i, p in zip(prompts.indices, prompts.prompts)]
        saved = self.store.sample(self.replay, torch.Generator().manual_seed(self.seed * 1_000_003 + step))
        return fresh + [replace(b, max_tokens=self.chunk_tokens) for b in saved]

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Advantages:
        """``[N]`` ``Â_i = v_i - v̄`` (see the module docstring), with ``v``, ``v̄`` and where ``v`` came from."""
        if batch.ends is None:
            raise ValueError("AC2: the batch does not say how its chunks ended (make it with a BranchRollout)")
        values, n = batch.rewards.float().clone(), batch.group_size
        valued = torch.zeros_like(values)
        completed = torch.zeros_like(values)
        cut = batch.ends.cut.nonzero().flatten().tolist()
        keys = batch.prompt_id.tolist() if batch.prompt_id is not None else batch.prompt_index.tolist()
        self._audit = []
        if cut:
            predicted = self.critic.values(self, [self.critic.context(self, end_history(batch, r), batch.prompts[r])
                                                  for r in cut]).tolist()
            ready = [self.readiness.ready(keys[r]) for r in cut]
            unready = [(r, v) for r, v, ok in zip(cut, predicted, ready) if not ok]
            if unready:  # complete them: the outcome is their value, and an audit of the critic
                out = self.trainer.datamodule.rollout_branches(
                    [Branch.from_rollout(batch, r) for r, _ in unready],
                    n=1, seed=(self.seed * 1_000_033 + self.global_step) % 2**31)
                for (r, v), outcome in zip(unready, out.rewards.tolist()):
                    values[r], completed[r] = outcome, 1.0
                    self.readiness.record(keys[r], abs(v - outcome))
            for r, v, ok in zip(cut, predicted, ready):
                if ok:
                    values[r], valued[r] = v, 1.0
                    self._audit.append(AuditItem(keys[r], Branch.from_rollout(batch, r), v))
            self._keep(batch, cut)
        target = values.view(-1, n).mean(dim=1, keepdim=True)
        rows = {VALUE: values, TARGET: target.expand(-1, n).reshape(-1), CRITIC_VALUED: valued, COMPLETED: completed}
        return Advantages((values.view(-1, n) - target).reshape(-1), rows=rows)

    def _keep(self, batch: RolloutBatch, rows: list[int]) -> None:
        """Store the unfinished chunks' ends that leave room for another chunk in the response."""
        for r in rows:
            end = batch.ends.states[r]
            if end is not None and end.snapshot_error is None and (
                    self.max_new_tokens is None or len(end.pending_ids) < self.max_new_tokens - 1):
                self.store.add([Branch.from_rollout(batch, r)])

    @override
    def auxiliary_rows(self, batch: RolloutBatch, adv: Advantages) -> list[AuxiliaryRows] | None:
        """The critic's cross-entropy at each prefix ``s`` to the nearest bin of ``v̄``."""
        if self.critic_coef == 0:
            return None
        starts, contexts = self.critic.start_contexts(self, batch)
        return [self.critic.ce_rows(self, contexts, adv.rows[TARGET][starts], self.critic_coef)]

    @override
    def before_update(self, batch: RolloutBatch, adv: Advantages, weights: Tensor) -> dict[str, list[Tensor]]:
        rows = adv.rows
        return {**super().before_update(batch, adv, weights), "train/chunk_value": [rows[VALUE].mean()],
                "train/critic_valued": [rows[CRITIC_VALUED].mean()], "train/completed": [rows[COMPLETED].mean()]}

    # ------------------------------------------------------------------ AuditedCritic
    def audit_candidates(self) -> list[AuditItem]:
        """The ready problems' unfinished chunks the critic valued this step."""
        return list(self._audit)

    def record_audits(self, keys: list[int], errors: list[float]) -> None:
        for key, error in zip(keys, errors):
            self.readiness.record(key, error)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["ac2"] = {"store": self.store.state_dict(), "readiness": self.readiness.state_dict()}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.store.load_state_dict(checkpoint["ac2"]["store"])
        self.readiness.load_state_dict(checkpoint["ac2"]["readiness"])
