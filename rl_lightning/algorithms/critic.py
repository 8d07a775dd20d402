"""``CriticLearner``: the critic a method holds (PPO and its family; TRPO with GAE) -- its value model, value loss,
optimiser parameter group, training passes and the targets the advantages come with.

The value model (``models.value.Critic``: a head on the policy backbone or a separate network, optionally bounded
to the reward range, BPCO's ``V = R_min + (R_max - R_min) sigmoid(h)``) is registered on the module as
``module.critic``, where the ``CriticWarmup`` and ``FreezeCriticModules`` callbacks find it. Its schedule:

* ``updates = 0`` (PPO's default): the value loss is part of every policy micro-batch's loss (one joint backward
  and optimiser step; the method adds ``loss`` to its ``extra_losses``);
* ``updates = K > 0``: before the actor update, ``K`` passes over the rollout batch on the value loss alone
  (``fit``), each in ``minibatches`` minibatches with their own optimiser step and gradient clip
  (``max_grad_norm``: EasyPPO's small clipped critic minibatches; SAO's two critic passes). In shared mode the
  critic then reads the policy's hidden states detached, so only the value head learns from it.

The targets: ``gae`` (PPO) and ``length_adaptive`` (BPCO, SAO) return ``Advantages`` with the rollout values
``V_old`` and the returns; a per-row weight of the value loss is ``Advantages.rows[VALUE_WEIGHTS]`` (EasyPPO).
Under DDP a critic-only backward leaves the policy's parameters without gradients, so ``updates > 0`` needs
``strategy: ddp_find_unused_parameters_true``; not validated at scale.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_finite, check_settings
from rl_lightning.algorithms.forward import PolicyOutput
from rl_lightning.algorithms.metrics import Metrics, Summed, TokenMean
from rl_lightning.functional import (
    clipped_value_loss, explained_variance, gae, length_adaptive_lambda, outcome_gae, outcome_token_rewards,
)
from rl_lightning.models.value import Critic, CriticMode, build_critic
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.episodes import left_pad
from rl_lightning.rollout.generation import position_ids_from_mask

#: ``Advantages.rows`` key of the per-row weights of the value loss (EasyPPO's noise weights)
VALUE_WEIGHTS = "value_weights"
#: ``Advantages.rows`` key of the per-response ``λ`` of length-adaptive GAE (logged as ``train/lambda_mean``)
GAE_LAMBDA = "gae_lambda"


class CriticLearner:
    """The critic of ``module`` (see the module docstring); built in the method's ``__init__``.

    Args:
        module: the method (an ``RLModule``) whose policy, tokenizer and backward the critic uses.
        mode: ``shared`` -- a value head on the policy backbone; ``separate`` -- its own network, initialised
            from ``model_name_or_path`` (default: the policy's checkpoint); ``adapter`` -- LoRA adapters of its own
            on the LoRA policy's frozen base, and a head (``models.value.Critic``; needs ``model.init_args.lora``).
        lr: learning rate of the critic's parameter group (``None``: the policy optimiser's).
        value_bounds: ``[R_min, R_max]``: a bounded value head (BPCO), ``None``: a linear one.
        value_clip: ε_v of the clipped value loss (``None``: plain squared error).
        updates: critic-only passes over each rollout batch before the actor update (0: the joint loss).
        minibatches: minibatches (optimiser steps) per critic pass; must divide the rows per device.
        max_grad_norm: gradient-norm clip of each critic minibatch (``None``: no clip).
        reference: a text template the separate critic reads before each prompt, filled with the prompt's reference
            answer (``{answer}``; BPCO's "reference answers or rubrics enter only the critic"); ``None``: the
            critic reads what the policy reads.
    """

    def __init__(self, module: Any, mode: CriticMode = "shared", model_name_or_path: str | None = None,
                 lr: float | None = None, value_bounds: tuple[float, float] | None = None,
                 value_clip: float | None = 0.2, updates: int = 0, minibatches: int = 1,
                 max_grad_norm: float | None = None, reference: str | None = None) -> None:
        check_settings(module, [
            ("critic_lr", lr, lr is None or lr > 0, "must be > 0 or null"),
            ("value_clip", value_clip, value_clip is None or value_clip > 0, "must be > 0 or null"),
            ("critic_updates", updates, updates >= 0, "must be >= 0"),
            ("critic_minibatches", minibatches, minibatches >= 1, "must be >= 1"),
            ("critic_max_grad_norm", max_grad_norm, max_grad_norm is None or max_grad_norm > 0, "must be > 0 or null"),
            ("value_bounds", value_bounds, value_bounds is None or (len(value_bounds) == 2
                                                                    and value_bounds[0] < value_bounds[1]),
             "must be [R_min, R_max] with R_min < R_max, or null"),
            ("critic_reference", reference, reference is None or (mode != "shared" and "{answer}" in reference),
             f"needs critic: separate or adapter (a head on the policy would let the policy read it) and an "
             f"{{answer}} field (critic={mode!r})")])
        self.module, self.mode, self.lr, self.value_clip = module, mode, lr, value_clip
        self.updates, self.minibatches = updates, minibatches
        self.max_grad_norm, self.reference = max_grad_norm, reference
        bounds = None if value_bounds is None else (float(value_bounds[0]), float(value_bounds[1]))
        module.critic = build_critic(mode, module.policy, model_name_or_path or module.hparams.model_name_or_path,
                                     module.hparams.dtype, bounds)
        #: the joint update reads the values from the policy forward's hidden states
        self.reads_policy_hidden = mode == "shared" and updates == 0

    @property
    def model(self) -> Critic:
        return self.module.critic

    def parameter_group(self) -> dict[str, Any]:
        """The critic's optimiser parameter group (named ``critic``: logged as ``train/lr_critic``)."""
        group: dict[str, Any] = {"params": self.model.trainable(), "name": "critic"}
        if self.lr is not None:
            group["lr"] = self.lr
        return group

    # ------------------------------------------------------------------ values and their loss
    def values(self, batch: RolloutBatch, out: PolicyOutput | None = None, detach_hidden: bool = False) -> Tensor:
        """``[n, T]`` values of ``batch``'s rows (masked). In shared mode the head reads ``out.hidden`` (the policy
        forward's), or -- without it -- the hidden states of a forward of its own, detached when ``detach_hidden``
        (then only the head learns from the value loss)."""
        hidden = None if out is None else out.hidden
        if self.mode == "shared" and hidden is None:
            with torch.set_grad_enabled(torch.is_grad_enabled() and not detach_hidden):
                hidden = self.module.forward_policy(batch, with_hidden=True).hidden
        ids, mask, prompt_length = self.inputs(batch)
        values = self.model.values(ids, mask, position_ids_from_mask(mask), prompt_length, hidden=hidden)
        return values.float() * batch.loss_mask

    def inputs(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, int]:
        """``(ids, attention mask, prompt length)`` the critic reads: the batch's own, or with ``reference`` each
        row's prompt preceded by the filled template (the rows re-left-padded; the response columns and so the
        positions of the values stay those of the batch)."""
        if self.reference is None:
            return batch.input_ids, batch.attention_mask, batch.prompt_length
        if len(batch.prompts) != batch.num_rows or any(p.answer is None for p in batch.prompts):
            raise ValueError(f"{type(self.module).__name__}: critic_reference needs every row's prompt with its "
                             "reference answer (Prompt.answer)")
        p, tokenizer = batch.prompt_length, self.module.tokenizer
        rows = []
        for i, prompt in enumerate(batch.prompts):
            own = batch.input_ids[i, :p][batch.attention_mask[i, :p].bool()].tolist()
            extra = tokenizer(self.reference.format(answer=prompt.answer), add_special_tokens=False)
            rows.append(list(extra["input_ids"]) + own)
        ids, mask = left_pad(rows, tokenizer.pad_token_id, batch.input_ids.device)
        ids = torch.cat([ids, batch.input_ids[:, p:]], dim=1)
        return ids, torch.cat([mask, batch.attention_mask[:, p:]], dim=1), mask.shape[1]

    def rollout_values(self, batch: RolloutBatch) -> Tensor:
        """``[N, T]`` the critic's values at rollout time (``V_old``), no gradient."""
        with torch.no_grad():
            return self.values(batch)

    def loss(self, batch: RolloutBatch, values: Tensor, adv: Advantages, weights: Tensor) -> tuple[Tensor, Metrics]:
        """The value loss of ``batch``'s rows toward ``adv.returns``: ``clipped_value_loss`` with ``value_clip``
        around ``adv.values``, the aggregation ``weights`` times the rows' ``VALUE_WEIGHTS`` if any."""
        rows = adv.rows.get(VALUE_WEIGHTS)
        if rows is not None:
            weights = weights * rows.to(weights.dtype).unsqueeze(-1)
        loss, stats = clipped_value_loss(values, adv.values, adv.returns, batch.loss_mask, weights, self.value_clip)
        metrics: Metrics = {"train/value_loss": Summed(loss.detach())}
        if self.value_clip is not None:
            metrics["train/value_clip_fraction"] = TokenMean(stats.value_clip_fraction)
        return loss, metrics

    # ------------------------------------------------------------------ the critic's own passes
    def fit(self, batch: RolloutBatch, adv: Advantages, weights: Tensor, optimizer: Any) -> dict[str, list[Tensor]]:
        """``updates`` passes x ``minibatches`` optimiser steps on the value loss alone (inner steps: not counted by
        Lightning), each minibatch's critic gradient clipped to ``max_grad_norm``."""
        module, stats, rows = self.module, {}, batch.num_rows
        if rows % self.minibatches:
            raise ValueError(f"{type(module).__name__}: critic_minibatches={self.minibatches} does not divide the "
                             f"{rows} rows of a rollout batch")
        params = [p for p in self.model.trainable() if p.requires_grad]
        for update in range(self.updates):
            order = torch.arange(rows, device=batch.loss_mask.device)
            if self.minibatches > 1:
                gen = torch.Generator().manual_seed(module.seed * 1_000_003 + module.global_step * 1_009 + 500 + update)
                order = torch.randperm(rows, generator=gen).to(batch.loss_mask.device)
            for index, chunk in enumerate(order.chunk(self.minibatches)):
                mb, mb_adv = (batch.select(chunk), adv.select(chunk)) if self.minibatches > 1 else (batch, adv)
                optimizer.zero_grad()
                loss, loss_stats = self.loss(mb, self.values(mb, detach_hidden=True), mb_adv,
                                             weights[chunk] * self.minibatches)
                check_finite(loss.detach(), "value loss", module.global_step, update, index)
                if loss.requires_grad:  # not while a callback has frozen the whole critic
                    module.manual_backward(loss)
                grads = [p for p in params if p.grad is not None]
                if grads:
                    norm = torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm or float("inf"))
                    check_finite(norm, "critic gradient norm", module.global_step, update, index)
                    stats.setdefault("train/critic_grad_norm", []).append(norm.detach())
                optimizer.optimizer.step()  # the raw torch step: only the actor's step is the global step
                for key, value in loss_stats.items():
                    stats.setdefault(key, []).append(getattr(value, "value", value).detach().float())
        optimizer.zero_grad()
        return stats

    # ------------------------------------------------------------------ targets
    def gae(self, batch: RolloutBatch, gamma: float, lam: float, whiten: bool) -> Advantages:
        """PPO's advantages (``functional.outcome_gae`` over the rollout values ``V_old``) with
        ``returns = Â + V_old``."""
        values = self.rollout_values(batch)  # V_old, [N, T]
        advantages, returns = outcome_gae(batch.rewards.float(), values, batch.loss_mask, gamma, lam, whiten=whiten)
        return Advantages(advantages, values=values, returns=returns)

    def length_adaptive(self, batch: RolloutBatch, alpha: float, gamma: float = 1.0) -> Advantages:
        """Actor GAE with ``λ_π(L) = clamp(1 - 1/(α L), 0, 1)`` per response of ``L`` generated tokens over the
        rollout values, and critic targets with ``λ_V = 1`` (BPCO, and SAO's ``α = 1.5``): the discounted outcome
        reward-to-go itself, never built from the critic's own predictions. The outcome reward sits on the last
        *model-generated* token and the recursion skips observation tokens (``functional.gae`` over ``loss_mask``).
        The raw advantages ``[N, T]``, with ``rows[GAE_LAMBDA]`` (``[N]``)."""
        mask = batch.loss_mask
        values = self.rollout_values(batch)  # V_old, [N, T]
        rewards = outcome_token_rewards(batch.rewards.float(), mask)
        lam = length_adaptive_lambda(mask.sum(dim=1), alpha)  # [N], one λ per response
        advantages, _ = gae(rewards, values, mask, gamma, lam)
        _, returns = gae(rewards, torch.zeros_like(values), mask, gamma, 1.0)  # with V = 0: the reward-to-go
        return Advantages(advantages, values=values, returns=returns, rows={GAE_LAMBDA: lam})

    def metrics(self, batch: RolloutBatch, adv: Advantages) -> dict[str, list[Tensor]]:
        """``train/explained_variance`` of the values the advantages came from (``V_old``) against the returns."""
        return {"train/explained_variance": [explained_variance(adv.values, adv.returns, batch.loss_mask)]}

    def parameters(self) -> list[nn.Parameter]:
        return self.model.trainable()
