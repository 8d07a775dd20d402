"""Critic schedules for any method with a value model: ``CriticWarmup`` and ``FreezeCriticModules``.

They work with any ``LightningModule`` that has a ``policy`` and a ``critic`` attribute (both ``nn.Module``):
PPO today, SAO / BPCO / EasyPPO later (value pre-training as in VC-PPO, arXiv 2503.01491, and
VAPO, arXiv 2504.05118; SAO's critic warm-up and frozen critic attention, docs/algorithms.md, SAO).

Both are pure functions of ``trainer.global_step`` (rollout batches done) and their configuration, so they
need no checkpointed state: after a resume from step ``k`` they take the same decisions as a straight run.
They re-apply their ``requires_grad`` flags in ``on_train_batch_start`` of every step (so a fresh module
restored from a checkpoint is put in the right phase before its first update) and put the flags they
changed back at ``teardown``, leaving the module as they found it.

A parameter with ``requires_grad=False`` gets no gradient: the update loop of ``RLModule`` clips and steps
only parameters with a gradient, and torch optimisers skip parameters whose ``.grad`` is ``None`` (no
momentum or weight-decay drift), so frozen weights stay bit-identical.

Under DDP, parameters frozen *after* the model was wrapped leave DDP waiting for their gradients: run these
callbacks with ``strategy: ddp_find_unused_parameters_true``. Not validated at scale.
"""

from __future__ import annotations

import re
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from rl_lightning.models.adapters import actor_parameters
from rl_lightning.models.value import Critic


def _policy_and_critic(owner: str, pl_module: LightningModule) -> tuple[nn.Module, nn.Module]:
    """``(pl_module.policy, pl_module.critic)``, or a clear error naming the callback and the module class."""
    name = type(pl_module).__name__
    critic = getattr(pl_module, "critic", None)
    if not isinstance(critic, nn.Module):
        raise TypeError(f"{owner} needs a method with a critic (module.critic); {name} has none")
    policy = getattr(pl_module, "policy", None)
    if not isinstance(policy, nn.Module):
        raise TypeError(f"{owner} needs a method with a policy (module.policy); {name} has none")
    return policy, critic


def _own_critic_parameters(policy: nn.Module, critic: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The critic's named parameters that are not also the actor's (a shared backbone belongs to the policy; a
    ``models.value.Critic`` in ``adapter`` mode adds its adapters, which live in the policy: ``named_trainable``)."""
    shared = {id(p) for p in actor_parameters(policy)}
    named = critic.named_trainable() if isinstance(critic, Critic) else list(critic.named_parameters())
    return [(n, p) for n, p in named if id(p) not in shared]


class _FlagKeeper:
    """Sets ``requires_grad=False`` on parameters and puts their original flags back on ``restore``."""

    def __init__(self) -> None:
        self.saved: list[tuple[nn.Parameter, bool]] | None = None

    def freeze(self, params: list[nn.Parameter]) -> bool:
        """Freeze ``params``; returns True if they were not frozen by this keeper yet."""
        if self.saved is not None:
            for p, _ in self.saved:  # re-apply: robust to anything that re-enabled them
                p.requires_grad_(False)
            return False
        self.saved = [(p, p.requires_grad) for p in params]
        for p in params:
            p.requires_grad_(False)
        return True

    def restore(self) -> bool:
        """Put the saved flags back; returns True if anything was frozen."""
        if self.saved is None:
            return False
        for p, flag in self.saved:
            p.requires_grad_(flag)
        self.saved = None
        return True


class CriticWarmup(Callback):
    """Train only the critic for the first ``steps`` training steps (rollout batches).

    While ``trainer.global_step < steps`` every parameter of ``pl_module.policy`` has ``requires_grad=False``,
    so the policy loss moves nothing and only the value loss trains the critic: in PPO's ``shared`` mode that is
    the value head on a frozen backbone, in ``separate`` mode the critic's own network. From step ``steps`` on
    the policy's original flags are restored. Advantages during warm-up come from a critic still learning,
    which is the point: the actor starts once the values are meaningful.

    Logs ``train/critic_warmup`` (1 during warm-up, 0 after) at the rollout's step.

    Args:
        steps: number of critic-only training steps (0 disables the warm-up).

    Stateless: the phase is derived from ``trainer.global_step``, so a resumed run continues the schedule.
    """

    def __init__(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"CriticWarmup: steps must be an integer >= 0, got {steps!r}")
        self.steps = steps
        self._frozen = _FlagKeeper()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(steps=self.steps)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        policy, critic = _policy_and_critic("CriticWarmup", pl_module)
        if not _own_critic_parameters(policy, critic):
            raise ValueError(
                f"CriticWarmup: {type(pl_module).__name__}.critic has no parameters of its own (all are the "
                f"policy's), so a critic-only warm-up would train nothing"
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        warm = trainer.global_step < self.steps
        policy, _ = _policy_and_critic("CriticWarmup", pl_module)
        if warm:
            if self._frozen.freeze(actor_parameters(policy)):  # a critic's adapters in the policy keep training
                rank_zero_info(f"CriticWarmup: actor frozen, critic-only steps until step {self.steps}")
        elif self._frozen.restore():
            rank_zero_info(f"CriticWarmup: warm-up over at step {trainer.global_step}, actor unfrozen")
        value = float(warm)
        pl_module.log("train/critic_warmup", value, on_step=True, on_epoch=False, logger=False, batch_size=1)
        if trainer.is_global_zero:  # same x-axis as the module's train/* metrics: the rollout's step
            for logger in trainer.loggers:
                logger.log_metrics({"train/critic_warmup": value}, step=trainer.global_step)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._frozen.restore()


class FreezeCriticModules(Callback):
    """Freeze the critic parameters whose qualified names match a regex, from step ``after_step`` on.

    Names are those of ``pl_module.critic.named_parameters()`` (``re.search``), e.g. ``["self_attn"]`` freezes
    every attention projection of PPO's separate critic (``backbone.model.layers.0.self_attn.q_proj.weight``,
    ...), SAO's "freeze attention". Parameters the critic shares with the policy are never touched. Typical
    use: ``after_step`` = the ``CriticWarmup`` length, so the whole critic warms up and then only its MLPs
    and head keep learning.

    Args:
        patterns: regular expressions; each must match at least one critic parameter (checked at setup).
        after_step: first training step (rollout batch) at which the parameters are frozen.

    Stateless: the decision is derived from ``trainer.global_step``, so a resumed run continues the schedule.
    """

    def __init__(self, patterns: list[str], after_step: int = 0) -> None:
        if isinstance(patterns, str) or not patterns:
            raise ValueError(f"FreezeCriticModules: patterns must be a non-empty list of regexes, got {patterns!r}")
        if isinstance(after_step, bool) or not isinstance(after_step, int) or after_step < 0:
            raise ValueError(f"FreezeCriticModules: after_step must be an integer >= 0, got {after_step!r}")
        self.regexes: list[re.Pattern[str]] = []
        for pattern in patterns:
            try:
                self.regexes.append(re.compile(pattern))
            except (re.error, TypeError) as err:
                raise ValueError(f"FreezeCriticModules: invalid pattern {pattern!r}: {err}") from None
        self.patterns = list(patterns)
        self.after_step = after_step
        self._frozen = _FlagKeeper()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(patterns=self.patterns, after_step=self.after_step)

    def matched(self, pl_module: LightningModule) -> list[tuple[str, nn.Parameter]]:
        """The critic's own named parameters matching any pattern."""
        policy, critic = _policy_and_critic("FreezeCriticModules", pl_module)
        return [(n, p) for n, p in _own_critic_parameters(policy, critic) if any(r.search(n) for r in self.regexes)]

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        policy, critic = _policy_and_critic("FreezeCriticModules", pl_module)
        names = [n for n, _ in _own_critic_parameters(policy, critic)]
        for pattern, regex in zip(self.patterns, self.regexes):
            if not any(regex.search(n) for n in names):
                shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise ValueError(
                    f"FreezeCriticModules: pattern {pattern!r} matches no parameter of "
                    f"{type(pl_module).__name__}.critic ({len(names)} parameters, e.g. {shown or 'none'})"
                )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step < self.after_step:
            self._frozen.restore()  # before the switch (only matters if a fit is restarted at an earlier step)
            return
        params = [p for _, p in self.matched(pl_module)]
        if self._frozen.freeze(params):
            count = sum(p.numel() for p in params)
            rank_zero_info(f"FreezeCriticModules: froze {len(params)} critic tensors ({count} weights) matching "
                           f"{self.patterns} at step {trainer.global_step}")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._frozen.restore()
