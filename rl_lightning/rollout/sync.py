"""``SamplerSync``: the weights the rollout engine samples with -- which, when they follow the learner's, in which
dtype, and their version (the learner updates they had seen).

* ``interval == 1``, no ``dtype``, synchronous, on an in-process engine: the engine generates with the learner's
  policy itself (``ModuleEngine.bound``); every rollout sees the current weights and nothing is copied.
* Otherwise the engine holds weights of its own (``RolloutEngine.setup``: for the in-process engines a copy of
  the policy in ``dtype``), made at the first training rollout, and takes the learner's (``load_weights``) once
  ``interval`` steps have passed since it last did: a lagged sampler (``sampling.sync_interval``) or a
  low-precision one (``sampling.dtype``). A checkpoint keeps those weights, so a resumed run samples as the
  straight one.
* Asynchronous rollouts (``publish`` / ``refresh``): the learner publishes a snapshot of its weights whenever it
  takes a batch; the producer's thread loads the newest before each generation.

Held-out rollouts use the learner's current weights (``current``): an in-process engine bound to the policy;
another engine loads them (a sync, from which its lag restarts).

A policy sharded by FSDP2 (``models.sharding``) is never sampled from directly (a decode step would run outside
the FSDP root's forward): the engine holds a plain copy, set up from the gathered weights, and every sync gathers
them once (``full_state_dict``, a collective every rank reaches at the same step), not once per token.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from rl_lightning.models.adapters import has_adapters, merged_state_dict
from rl_lightning.models.sharding import full_state_dict, is_sharded, unsharded_copy
from rl_lightning.rollout.engine import IN_PROCESS, RolloutEngine


def _sharded(policy: nn.Module) -> bool:
    return torch.distributed.is_available() and is_sharded(policy)


def _weights(policy: nn.Module, plain: bool = False) -> Mapping[str, Tensor]:
    """The learner's full weights: its state dict, gathered when it is sharded; with ``plain``, LoRA adapters
    merged under the base model's names (``adapters.merged_state_dict``: what an engine outside this process
    loads, which knows nothing of adapters)."""
    if plain and has_adapters(policy):
        return merged_state_dict(policy)
    return full_state_dict(policy) if _sharded(policy) else policy.state_dict()


class SamplerSync:
    """Owns the sampling weights of ``engine`` (see the module docstring).

    Args:
        engine: the rollout engine.
        interval: training steps between two syncs (1: every step).
        dtype: the sampler's dtype (``None``: the policy's own).
        asynchronous: the engine samples on a producer thread, with weights of its own (``publish``/``refresh``).
    """

    def __init__(self, engine: RolloutEngine, interval: int = 1, dtype: str | None = None,
                 asynchronous: bool = False) -> None:
        self.engine, self.interval, self.dtype, self.asynchronous = engine, interval, dtype, asynchronous
        self.synced_at = -1  # the training step at which the engine's weights were last the learner's
        self.ready = False  # the engine's own weights were set up
        self._views: dict[int, RolloutEngine] = {}  # in-process engines bound to a policy, by id(policy)
        self._pending: dict[str, Any] | None = None
        self._published: tuple[int, dict[str, Tensor]] | None = None
        self._kept: dict[str, Tensor] | None = None  # a lagged sampler's weights, for an engine that cannot read them
        self._lock = threading.Lock()

    def _engine_weights(self, policy: nn.Module) -> Mapping[str, Tensor]:
        """The learner's weights as the engine loads them: an in-process copy of the policy has its structure
        (adapters included); any other engine takes plain weights (adapters merged)."""
        return _weights(policy, plain=IN_PROCESS not in self.engine.capabilities)

    def _bindable(self, policy: nn.Module) -> bool:
        """Whether the engine can generate with ``policy`` itself (in process, not sharded)."""
        return IN_PROCESS in self.engine.capabilities and not _sharded(policy)

    def shares(self, policy: nn.Module) -> bool:
        """Whether training rollouts generate with the learner's ``policy`` itself (no copy, no sync)."""
        return self.interval == 1 and self.dtype is None and not self.asynchronous and self._bindable(policy)

    @property
    def version(self) -> int:
        """The version of the weights the engine's training rollouts sample with."""
        return self.engine.version

    def _view(self, policy: nn.Module) -> RolloutEngine:
        if id(policy) not in self._views:
            self._views = {id(policy): self.engine.bound(policy)}
        return self._views[id(policy)]

    def _keep(self, weights: Mapping[str, Tensor]) -> None:
        """Keep a CPU copy of the weights a lagged sampler now holds when its engine cannot give them back
        (``weights()`` is ``None``: vLLM), so a checkpoint still has them and a resumed run samples as the straight
        one. Nothing is copied at ``interval == 1`` (the sampler's weights are then the learner's)."""
        if self.interval > 1 and not self.asynchronous and self.engine.weights() is None:
            self._kept = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}

    def _load(self, weights: Mapping[str, Tensor], version: int) -> None:
        self.engine.load_weights(weights, version)
        self._keep(weights)

    def start(self, policy: nn.Module, version: int) -> RolloutEngine:
        """Set up the engine's own weights from ``policy`` (once; a resumed run's saved ones replace them)."""
        if not self.ready:
            self.engine.setup(unsharded_copy(policy) if _sharded(policy) else policy, self.dtype, version)
            self.ready, self.synced_at = True, version
            self._keep(self._engine_weights(policy))
            if self._pending is not None:
                self._load(self._pending["sampler"], self._pending["sampler_synced_at"])
                self.synced_at, self._pending = self._pending["sampler_synced_at"], None
        return self.engine

    def for_step(self, policy: nn.Module, step: int) -> RolloutEngine:
        """The engine ready for training step ``step``: synced if ``interval`` steps have passed."""
        if self.shares(policy):
            return self._view(policy)
        engine = self.start(policy, step)
        if step - self.synced_at >= self.interval:
            self._load(self._engine_weights(policy), step)
            self.synced_at = step
        return engine

    def current(self, policy: nn.Module, version: int) -> RolloutEngine:
        """An engine that samples with the learner's weights now (after ``version`` updates)."""
        if self._bindable(policy):
            return self._view(policy)
        engine = self.start(policy, version)
        if engine.version != version:
            self._load(self._engine_weights(policy), version)
            self.synced_at = version
        return engine

    def model(self, policy: nn.Module, step: int) -> nn.Module | None:
        """The module training step ``step`` samples with (in-process engines; ``None`` for others)."""
        return getattr(self.for_step(policy, step), "model", None)

    # ------------------------------------------------------------------ asynchronous rollouts
    def publish(self, policy: nn.Module, version: int) -> None:
        """Offer the learner's current weights (after ``version`` updates) to the producer (a snapshot)."""
        state = {k: v.detach().clone() for k, v in self._engine_weights(policy).items()}
        with self._lock:
            self._published = (version, state)

    def refresh(self) -> None:
        """Load the newest published weights if they are newer than the engine's (the producer's thread)."""
        with self._lock:
            if self._published is not None and self._published[0] > self.engine.version:
                version, state = self._published
                self.engine.load_weights(state, version)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The lagged sampler's weights and sync step (nothing when it samples with the policy or asynchronously:
        those weights are the learner's)."""
        weights = (self.engine.weights() or self._kept) if self.ready and not self.asynchronous else None
        if weights is None:
            return {}
        return {"sampler": {k: v.detach().cpu() for k, v in weights.items()}, "sampler_synced_at": self.synced_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Sample with the saved weights from the next training rollout on (applied when the engine is set up)."""
        self.ready, self._published, self._views, self._kept = False, None, {}, None
        self._pending = dict(state) if "sampler" in state else None

