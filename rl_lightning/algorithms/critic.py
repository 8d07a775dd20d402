"""``ActorCritic``: the critic every method with a learned value model shares (PPO, TRPO with GAE, and the
critic methods of spec 000 built on them).

It owns the value model (a head on the policy backbone or a separate network, optionally bounded to the reward
range: BPCO's ``V = R_min + (R_max - R_min) sigmoid(h)``), its optimiser parameter group, its values at rollout
time, and its training schedule:

* ``critic_updates = 0`` (PPO's default): the value loss is part of every policy micro-batch's loss (one joint
  backward and optimiser step);
* ``critic_updates = K > 0``: before the actor update, ``K`` passes over the rollout batch on the value loss
  alone, each in ``critic_minibatches`` minibatches with their own optimiser step and their own gradient clip
  (``critic_max_grad_norm``, per minibatch: EasyPPO's small clipped critic minibatches; SAO's two critic updates
  per actor update). In shared mode the critic then reads the policy's hidden states detached, so only the
  value head learns from it; the actor's loss has no value term.

Critic-only warm-up steps and frozen critic modules (attention) are the ``CriticWarmup`` and
``FreezeCriticModules`` callbacks, which work on ``module.critic`` of any subclass. Under DDP a critic-only
backward leaves the policy's parameters without gradients, so ``critic_updates > 0`` (like those callbacks) needs
``strategy: ddp_find_unused_parameters_true``; not validated at scale. A method changes the value
loss through ``value_loss`` (EasyPPO's noise weights) and the targets in ``compute_advantages`` (BPCO's observed
final rewards).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from rl_lightning.algorithms.base import PolicyOutput, RLModule
from rl_lightning.functional import (
    clipped_value_loss,
    explained_variance,
    gae,
    length_adaptive_lambda,
    outcome_gae,
    outcome_token_rewards,
)
from rl_lightning.models.value import Critic, CriticMode, build_critic
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.episodes import left_pad
from rl_lightning.rollout.generation import position_ids_from_mask


class ActorCritic(RLModule):
    """Base of the methods with a critic (see the module docstring).

    Args:
        critic: ``shared`` -- a value head on the policy backbone; ``separate`` -- its own network, initialised
            from ``critic_model_name_or_path`` (default: the policy's checkpoint); ``None`` -- no critic (a
            subclass that only sometimes uses one, e.g. TRPO with group advantages).
        critic_model_name_or_path: checkpoint of the separate critic (``None``: ``model_name_or_path``).
        critic_lr: learning rate of the critic's parameters (``None``: the policy optimiser's).
        value_bounds: ``[R_min, R_max]``: a bounded value head (BPCO), ``None``: a linear one.
        value_clip: ε_v of the clipped value loss (``None``: plain squared error).
        critic_updates: critic-only passes over each rollout batch before the actor update (0: the value loss is
            added to the policy loss instead).
        critic_minibatches: minibatches (optimiser steps) per critic pass; must divide the rows per device.
        critic_max_grad_norm: gradient-norm clip of each critic minibatch (``None``: no clip).
        critic_reference: a text template the separate critic reads before each prompt, filled with the prompt's
            reference answer (``{answer}``; BPCO's "reference answers or rubrics enter only the critic"), e.g.
            ``"answer: {answer}\n"``; the policy never sees it. ``None``: the critic reads what the policy reads.
        **kwargs: ``RLModule`` arguments.
    """

    def __init__(
        self,
        critic: CriticMode | None = "shared",
        critic_model_name_or_path: str | None = None,
        critic_lr: float | None = None,
        value_bounds: tuple[float, float] | None = None,
        value_clip: float | None = 0.2,
        critic_updates: int = 0,
        critic_minibatches: int = 1,
        critic_max_grad_norm: float | None = None,
        critic_reference: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        name = type(self).__name__
        checks = {"critic_lr": critic_lr is None or critic_lr > 0, "value_clip": value_clip is None or value_clip > 0,
                  "critic_updates": critic_updates >= 0, "critic_minibatches": critic_minibatches >= 1,
                  "critic_max_grad_norm": critic_max_grad_norm is None or critic_max_grad_norm > 0,
                  "value_bounds": value_bounds is None
                  or (len(value_bounds) == 2 and value_bounds[0] < value_bounds[1])}
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: invalid {key}={locals()[key]!r}")
        self.critic_lr, self.value_clip = critic_lr, value_clip
        self.critic_updates, self.critic_minibatches = critic_updates, critic_minibatches
        self.critic_max_grad_norm = critic_max_grad_norm
        if critic_reference is not None and (critic != "separate" or "{answer}" not in critic_reference):
            raise ValueError(f"{name}: critic_reference needs critic: separate (a head on the policy would let the "
                             f"policy read it) and an {{answer}} field, got critic={critic!r}, "
                             f"critic_reference={critic_reference!r}")
        self.critic_reference = critic_reference
        self.critic: Critic | None = None
        if critic is not None:
            bounds = None if value_bounds is None else (float(value_bounds[0]), float(value_bounds[1]))
            self.critic = build_critic(critic, self.policy, critic_model_name_or_path
                                       or self.hparams.model_name_or_path, self.hparams.dtype, bounds)
            # the joint update reads the values from the policy forward's hidden states
            self.needs_hidden = critic == "shared" and critic_updates == 0

    # ------------------------------------------------------------------ optimiser plumbing
    @override
    def parameter_groups(self) -> list[dict[str, Any]]:
        groups = super().parameter_groups()
        if self.critic is None:
            return groups
        groups[0].setdefault("name", "policy")  # names give the logged rates theirs: train/lr, train/lr_critic
        critic_group: dict[str, Any] = {"params": list(self.critic.parameters()), "name": "critic"}
        if self.critic_lr is not None:
            critic_group["lr"] = self.critic_lr
        return [*groups, critic_group]

    @override
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [*self.policy.parameters(), *([] if self.critic is None else self.critic.parameters())]

    # ------------------------------------------------------------------ values and their loss
    def critic_values(self, batch: RolloutBatch, out: PolicyOutput | None = None,
                      detach_hidden: bool = False) -> Tensor:
        """``[n, T]`` values of ``batch``'s rows (masked). In shared mode the head reads ``out.hidden`` (the policy
        forward's), or -- without it -- the hidden states of a forward of its own, detached when
        ``detach_hidden`` (then only the head learns from the value loss)."""
        hidden = None if out is None else out.hidden
        if self.critic.mode == "shared" and hidden is None:
            with torch.set_grad_enabled(torch.is_grad_enabled() and not detach_hidden):
                hidden = self.forward_policy(batch, with_hidden=True).hidden
        ids, mask, prompt_length = self.critic_inputs(batch)
        values = self.critic.values(ids, mask, position_ids_from_mask(mask), prompt_length, hidden=hidden)
        return values.float() * batch.loss_mask

    def critic_inputs(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, int]:
        """``(ids, attention mask, prompt length)`` the critic reads: the batch's own, or with ``critic_reference``
        each row's prompt preceded by the filled template (the rows re-left-padded; the response columns and so
        the positions of the values stay those of the batch)."""
        if self.critic_reference is None:
            return batch.input_ids, batch.attention_mask, batch.prompt_length
        if len(batch.prompts) != batch.num_rows or any(p.answer is None for p in batch.prompts):
            raise ValueError(f"{type(self).__name__}: critic_reference needs every row's prompt with its reference "
                             "answer (Prompt.answer)")
        p = batch.prompt_length
        rows = []
        for i, prompt in enumerate(batch.prompts):
            own = batch.input_ids[i, :p][batch.attention_mask[i, :p].bool()].tolist()
            extra = self.tokenizer(self.critic_reference.format(answer=prompt.answer), add_special_tokens=False)
            rows.append(list(extra["input_ids"]) + own)
        ids, mask = left_pad(rows, self.tokenizer.pad_token_id, batch.input_ids.device)
        ids = torch.cat([ids, batch.input_ids[:, p:]], dim=1)
        return ids, torch.cat([mask, batch.attention_mask[:, p:]], dim=1), mask.shape[1]

    def rollout_values(self, batch: RolloutBatch) -> Tensor:
        """``[N, T]`` the critic's values at rollout time (``V_old``), no gradient."""
        with torch.no_grad():
            return self.critic_values(batch)

    def value_loss_weights(self, batch: RolloutBatch) -> Tensor | None:
        """``[n]`` per-row weights of the value loss (``None``: all 1) -- EasyPPO's noise weights. A hook."""
        return None

    def value_loss(self, batch: RolloutBatch, values: Tensor, weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The critic's loss on ``batch``'s rows toward ``batch.returns`` and its metrics (a hook): by default
        ``clipped_value_loss`` with ``value_clip`` around ``batch.values``, the aggregation ``weights`` times
        ``value_loss_weights`` (``train/value_clip_fraction`` logged when there is a clip)."""
        rows = self.value_loss_weights(batch)
        if rows is not None:
            weights = weights * rows.to(weights.dtype).unsqueeze(-1)
        loss, stats = clipped_value_loss(values, batch.values, batch.returns, batch.loss_mask, weights,
                                         self.value_clip)
        metrics = {"train/value_loss": loss.detach()}
        if self.value_clip is not None:
            metrics["train/value_clip_fraction"] = stats.value_clip_fraction
        return loss, metrics

    # ------------------------------------------------------------------ the critic's own updates
    def fit_critic(self, batch: RolloutBatch, weights: Tensor, optimizer: Any) -> dict[str, list[Tensor]]:
        """``critic_updates`` passes × ``critic_minibatches`` optimiser steps on ``value_loss`` alone (inner steps:
        not counted by Lightning), each minibatch's critic gradient clipped to ``critic_max_grad_norm``."""
        stats: dict[str, list[Tensor]] = {}
        rows = batch.num_rows
        if rows % self.critic_minibatches:
            raise ValueError(f"{type(self).__name__}: critic_minibatches={self.critic_minibatches} does not divide the "
                             f"{rows} rows of a rollout batch")
        params = [p for p in self.critic.parameters() if p.requires_grad]
        for update in range(self.critic_updates):
            order = torch.arange(rows, device=batch.loss_mask.device)
            if self.critic_minibatches > 1:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.global_step * 1_009 + 500 + update)
                order = torch.randperm(rows, generator=gen).to(batch.loss_mask.device)
            for index, chunk in enumerate(order.chunk(self.critic_minibatches)):
                mb = batch.select(chunk) if self.critic_minibatches > 1 else batch
                optimizer.zero_grad()
                loss, loss_stats = self.value_loss(mb, self.critic_values(mb, detach_hidden=True),
                                                   weights[chunk] * self.critic_minibatches)
                self._check_finite(loss.detach(), "value loss", update, index)
                if loss.requires_grad:  # not while a callback has frozen the whole critic
                    self.manual_backward(loss)
                grads = [p for p in params if p.grad is not None]
                if grads:
                    norm = torch.nn.utils.clip_grad_norm_(grads, self.critic_max_grad_norm or float("inf"))
                    self._check_finite(norm, "critic gradient norm", update, index)
                    stats.setdefault("train/critic_grad_norm", []).append(norm.detach())
                optimizer.optimizer.step()  # the raw torch step: only the actor's step is the global step
                for key, value in loss_stats.items():
                    stats.setdefault(key, []).append(value.detach().float())
        optimizer.zero_grad()
        return stats

    def gae_advantages(self, batch: RolloutBatch, gamma: float, lam: float, whiten: bool) -> Tensor:
        """PPO's advantages (``functional.outcome_gae`` over the critic's rollout values ``V_old``); sets
        ``batch.values``/``batch.returns`` (``returns = Â + V_old``, carried into every minibatch by ``select``)."""
        values = self.rollout_values(batch)  # V_old, [N, T]
        advantages, returns = outcome_gae(batch.rewards.float(), values, batch.loss_mask, gamma, lam, whiten=whiten)
        batch.values, batch.returns = values, returns
        return advantages

    def length_adaptive_advantages(self, batch: RolloutBatch, alpha: float, gamma: float = 1.0) -> Tensor:
        """Actor GAE with ``λ_π(L) = clamp(1 - 1/(α L), 0, 1)`` per response of ``L`` generated tokens over the
        critic's rollout values, and critic targets with ``λ_V = 1`` (BPCO, and SAO's ``α = 1.5``): the discounted
        outcome reward-to-go itself, never built from the critic's own predictions (``R`` at every token with
        ``γ = 1``). The outcome reward sits on the last *model-generated* token and the recursion skips observation
        tokens (``functional.gae`` over ``loss_mask``). Sets ``batch.values``/``batch.returns`` and
        ``batch.extras["gae_lambda"]`` (``[N]``); returns the raw advantages ``[N, T]``."""
        mask = batch.loss_mask
        values = self.rollout_values(batch)  # V_old, [N, T]
        rewards = outcome_token_rewards(batch.rewards.float(), mask)
        lam = length_adaptive_lambda(mask.sum(dim=1), alpha)  # [N], one λ per response
        advantages, _ = gae(rewards, values, mask, gamma, lam)
        _, returns = gae(rewards, torch.zeros_like(values), mask, gamma, 1.0)  # with V = 0: the reward-to-go
        batch.values, batch.returns = values, returns
        batch.extras["gae_lambda"] = lam
        return advantages

    def critic_metrics(self, batch: RolloutBatch) -> dict[str, list[Tensor]]:
        """``train/explained_variance`` of the values the advantages came from (``V_old``) against the returns."""
        return {"train/explained_variance": [explained_variance(batch.values, batch.returns, batch.loss_mask)]}
