"""``Ranks``: the collectives a method needs, the same call in one process (where each is the identity) and under
data parallelism (where each goes through the Lightning strategy's ``reduce``).

Every rank must make the same calls in the same order (each is a collective).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rl_lightning.models.sharding import shard_fully


class Ranks:
    """The ranks of a run (``trainer`` may be ``None``: a module used outside a Trainer is one process)."""

    def __init__(self, trainer: Any | None) -> None:
        self.trainer = trainer
        self.world_size = 1 if trainer is None else int(trainer.world_size)

    def _reduce(self, value: Tensor, op: str) -> Tensor:
        if self.world_size == 1:
            return value
        return self.trainer.strategy.reduce(value, reduce_op=op)

    def sum(self, value: Tensor) -> Tensor:
        """``value`` summed over every rank."""
        return self._reduce(value, "sum")

    def mean(self, value: Tensor) -> Tensor:
        """``value`` averaged over every rank."""
        return self._reduce(value, "mean")

    def max(self, value: Tensor) -> Tensor:
        """The elementwise maximum of ``value`` over every rank."""
        return self._reduce(value, "max")

    def gather_objects(self, obj: Any) -> list[Any]:
        """``[obj of rank 0, obj of rank 1, ...]``: one picklable object from every rank (``[obj]`` in one process).

        For per-prompt state a method keeps identical on every rank (SPO's tracker): each rank gathers every
        rank's updates and applies them in rank order, so the state is the same everywhere and in checkpoints.
        """
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered



def shard_module(module: Any, mesh: Any) -> None:
    """FSDP2 for an ``RLModule`` under ``ModelParallelStrategy`` (``mesh``: its device mesh, ``None`` otherwise: then
    nothing): the policy and a critic (``values`` registered as a forward) one unit per decoder block."""
    if mesh is None:
        return
    shard_fully(module.policy, mesh["data_parallel"])
    if getattr(module, "critic", None) is not None:
        shard_fully(module.critic, mesh["data_parallel"], forward_methods=("values",))
