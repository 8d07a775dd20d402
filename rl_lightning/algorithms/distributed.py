"""``Ranks``: the collectives a method needs, the same call in one process (where each is the identity) and under
data parallelism (where each goes through the Lightning strategy's ``reduce``).

Every rank must make the same calls in the same order (each is a collective).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


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


def shard_fully(model: nn.Module, mesh: Any, forward_methods: tuple[str, ...] = ()) -> None:
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) over ``mesh``: one unit per block the model names as not to
    be split (Hugging Face's ``_no_split_modules``, e.g. ``LlamaDecoderLayer``), then the rest as the root's unit.

    ``forward_methods``: methods other than ``forward`` that run the module (``Critic.values``), registered so
    that they gather its parameters too. Code that reads the parameters without a forward (a sampler's own decode
    loop) must work on a full copy (``full_state_dict``).
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in list(model.modules())[1:]:
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every sharded (``DTensor``) entry gathered into a full tensor on every rank (a
    collective under FSDP; a plain state dict otherwise)."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
