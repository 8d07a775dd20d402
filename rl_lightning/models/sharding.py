"""FSDP2 for the library's models: sharding a causal LM one decoder block at a time, and getting its full weights
back (for a sampler that reads the parameters without a forward, for checks, for a plain copy).

``torch.distributed.fsdp.fully_shard`` replaces a module's parameters by ``DTensor`` shards and gathers them
around every ``forward``. Code that reads parameters directly -- a decode loop with a static cache, an engine in
another process -- needs the full tensors: ``full_state_dict`` gathers them once (a collective: every rank calls
it), ``unsharded_copy`` builds a plain module holding them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn


def shard_fully(model: nn.Module, mesh: Any, forward_methods: tuple[str, ...] = ()) -> None:
    """FSDP2 over ``mesh``: one unit per block the model names as not to be split (Hugging Face's
    ``_no_split_modules``, e.g. ``LlamaDecoderLayer``), then the rest as the root's unit. ``forward_methods``:
    methods other than ``forward`` that run the module (``Critic.values``), registered so that they gather its
    parameters too."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in list(model.modules())[1:]:
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` shard (FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every sharded entry gathered into a full tensor on every rank (a collective under
    FSDP2; the plain state dict otherwise)."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def unsharded_copy(model: nn.Module) -> nn.Module:
    """A plain causal LM with ``model``'s architecture (rebuilt from its Hugging Face ``config``) and full weights."""
    from transformers import AutoModelForCausalLM

    state = full_state_dict(model)
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"unsharded_copy: cannot rebuild a {type(model).__name__} without a Hugging Face config")
    plain = AutoModelForCausalLM.from_config(config)
    first = next(iter(state.values()))
    plain.to(dtype=first.dtype, device=first.device)
    plain.load_state_dict(state)
    return plain
