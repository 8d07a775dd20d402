"""Saved activations recomputed from tensors autograd keeps anyway: one less copy of the gated MLP's products and of
the RMS norm's normalised input per layer, with the same forward and gradient bits.

A Llama-style decoder layer (Llama, SmolLM2, Qwen 2/3, Mistral) runs ``down(act(gate(x)) * up(x))`` and
``weight * (x * rsqrt(mean(x²) + eps))``. For the backward, autograd keeps ``gate(x)`` (the activation's input),
``act(gate(x))`` and ``up(x)`` (the product's inputs), the product itself (the down projection's input) and, in
each norm, ``x``, the ``rsqrt`` and the normalised ``x`` (the weight's multiplier). The activation, the product and
the normalised input are cheap elementwise functions of tensors that are kept anyway, so ``recompute_activations``
has the layer save, in their place, how to rebuild them (``torch.autograd.graph.saved_tensors_hooks``), and the
backward rebuilds each one when it needs it, with the kernel the forward ran on the same inputs: the same bits. Per
token and layer that is ``2 x intermediate + 2 x hidden`` values fewer when every weight trains (on SmolLM2-135M at
8 x 8: about 1 GB of the update's peak, ``experiments/bench_vs_trl_smollm2.py``), fewer with frozen weights (whose
products autograd does not keep). It costs the elementwise arithmetic again, no matrix product.

Safety rules, each checked:

* a module switches only if its forward gives the same output bits as its class's own on a probe input, once per
  class (a class whose forward differs, e.g. Gemma's ``1 + weight`` norm, keeps its own);
* the hooks cover only products whose saved tensors are their inputs (an op that saves its own output, e.g.
  dropout's mask, would make a reference cycle through the hook that a forward without backward never frees): the
  elementwise products themselves, and the down projection only where it is an ``nn.Linear`` or a LoRA
  ``Linear`` of ``nn.Linear``s without dropout or DoRA;
* nothing changes under other saved-tensor hooks (gradient checkpointing, which drops these tensors anyway;
  activation offloading) or without grad mode.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

_PROBED: dict[tuple[type, str], bool] = {}
"""Per (class, kind): whether ``recompute_activations``' forward gives the class's own output bits."""


class _Rebuild:
    """A saved tensor replaced by how to compute it: ``fn(*inputs)``, viewed as the saved tensor was."""

    __slots__ = ("fn", "inputs", "size", "stride", "offset")

    def __init__(self, fn: Callable[..., Tensor], inputs: tuple[Tensor, ...], saved: Tensor) -> None:
        self.fn, self.inputs = fn, inputs
        self.size, self.stride, self.offset = saved.size(), saved.stride(), saved.storage_offset()

    def __call__(self) -> Tensor:
        return self.fn(*self.inputs).as_strided(self.size, self.stride, self.offset)


def _unpack(packed: Any) -> Tensor:
    return packed() if isinstance(packed, _Rebuild) else packed


class _Recipes(torch.autograd.graph.saved_tensors_hooks):
    """Within it, a saved tensor that is (a view of) ``out`` of one of ``recipes`` ``(out, fn, inputs)`` is saved as
    ``fn(*inputs)`` (``out`` must be a fresh contiguous result of ``fn`` on contiguous ``inputs``, alive throughout);
    every other saved tensor is kept as autograd keeps it."""

    def __init__(self, *recipes: tuple[Tensor, Callable[..., Tensor], tuple[Tensor, ...]]) -> None:
        known = {}
        for out, fn, inputs in recipes:
            if out.is_contiguous() and out.storage_offset() == 0 and all(t.is_contiguous() for t in inputs):
                known[(out.untyped_storage().data_ptr(), out.dtype)] = (out.numel(), fn, inputs)

        def pack(saved: Tensor) -> Any:
            hit = known.get((saved.untyped_storage().data_ptr(), saved.dtype))
            if hit is None or saved.untyped_storage().nbytes() != hit[0] * saved.element_size():
                return saved
            return _Rebuild(hit[1], hit[2], saved)

        super().__init__(pack, _unpack)


def _plain(module: nn.Module) -> type:
    """The class ``module`` had before ``recompute_activations`` switched it."""
    cls = type(module)
    return cls.__mro__[1] if "_recomputes" in vars(cls) else cls


def _hooks_free() -> bool:
    """Grad mode on, saved-tensor hooks allowed and none set by anyone else (checkpointing, offloading)."""
    return (torch.is_grad_enabled() and torch._C._autograd._saved_tensors_hooks_is_enabled()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)


def _plain_linears(module: nn.Module) -> bool:
    """``module`` saves only its inputs: an ``nn.Linear``, or a LoRA layer over ``nn.Linear``s with no dropout
    (``nn.Identity``) and no DoRA magnitude."""
    if type(module) is nn.Linear:
        return True
    allowed = (nn.Linear, nn.Identity, nn.ModuleDict, nn.ParameterDict)
    magnitude = getattr(module, "lora_magnitude_vector", None)
    return (hasattr(module, "lora_A") and not magnitude
            and all(type(m) in allowed for name, m in module.named_modules() if name))


def gated_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    """``down(act(gate(x)) * up(x))`` (Hugging Face's ``LlamaMLP.forward``) with the activation and the product
    saved as how to rebuild them. The backward rebuilds the product first (the down projection's); the activation
    it computed on the way is handed to the product's own backward, which follows, instead of computed twice."""
    if not _hooks_free():
        return _plain(self).forward(self, x)
    g = self.gate_proj(x)
    act = self.act_fn(g)
    u = self.up_proj(x)
    handed: list[Tensor] = []

    def rebuild_act(g: Tensor) -> Tensor:
        return handed.pop() if handed else self.act_fn(g)

    def rebuild_product(g: Tensor, u: Tensor) -> Tensor:
        a = self.act_fn(g)
        handed[:] = [a]
        return a * u

    with _Recipes((act, rebuild_act, (g,))):
        h = act * u
    del act
    if not _plain_linears(self.down_proj):
        return self.down_proj(h)
    with _Recipes((h, rebuild_product, (g, u))):
        return self.down_proj(h)


def _normalised(x: Tensor, rstd: Tensor, dtype: torch.dtype) -> Tensor:
    return (x * rstd).to(dtype)


def rms_norm_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    """``weight * (x * rsqrt(mean(x²) + eps))`` in float32 (Hugging Face's ``LlamaRMSNorm.forward``) with the
    normalised ``x`` saved as how to rebuild it."""
    if not _hooks_free():
        return _plain(self).forward(self, hidden_states)
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    normalised = (x * rstd).to(dtype)
    with _Recipes((normalised, lambda a, b: _normalised(a, b, dtype), (x, rstd))):
        return self.weight * normalised


def _is_gated_mlp(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Module)
               for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _is_rms_norm(module: nn.Module) -> bool:
    return (isinstance(getattr(module, "weight", None), nn.Parameter) and module.weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float) and "RMSNorm" in type(module).__name__)


def _same_bits(module: nn.Module, forward: Callable[[nn.Module, Tensor], Tensor], width: int) -> bool:
    """Whether ``forward`` gives ``module``'s class forward's output bits on a probe input (once per class)."""
    key = (type(module), forward.__name__)
    if key not in _PROBED:
        parameter = next(module.parameters())
        probe = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(0)).to(parameter)
        with torch.enable_grad():
            try:
                ours = forward(module, probe)
            except Exception:  # noqa: BLE001 -- any forward that cannot run ours keeps its own
                _PROBED[key] = False
                return False
            theirs = type(module).forward(module, probe)
        _PROBED[key] = ours.shape == theirs.shape and torch.equal(ours, theirs)
    return _PROBED[key]


_FORWARDS = {"gated_mlp": gated_mlp_forward, "rms_norm": rms_norm_forward}
_SUBCLASSES: dict[tuple[type, str], type] = {}


def _recomputing(cls: type, kind: str) -> type:
    """``cls`` with ``_FORWARDS[kind]`` as its forward: a subclass of the same name (made once per class). A subclass
    and not an instance ``forward``, which Hugging Face's kernel layer resets on every ``train()``/``eval()``; it
    pickles (``copy.deepcopy``, spawned processes) as ``cls`` switched again."""
    key = (cls, kind)
    if key not in _SUBCLASSES:
        def reduce(self: nn.Module, protocol: int) -> tuple:
            return _rebuild, (cls, kind), self.__getstate__()

        _SUBCLASSES[key] = type(cls.__name__, (cls,), {"forward": _FORWARDS[kind], "__reduce_ex__": reduce,
                                                        "_recomputes": kind, "__module__": cls.__module__})
    return _SUBCLASSES[key]


def _rebuild(cls: type, kind: str) -> nn.Module:
    module = cls.__new__(cls)
    module.__class__ = _recomputing(cls, kind)
    return module


def recompute_activations(model: nn.Module, enable: bool = True) -> int:
    """Switch every gated MLP and RMS norm of ``model`` to the forwards above, in place (each module's class becomes
    a subclass with that forward); the number of modules switched. Modules whose class forward differs from these
    on a probe are left alone. ``enable=False`` switches them back (benchmarks, bisecting)."""
    switched = 0
    for module in model.modules():
        kind = getattr(type(module), "_recomputes", None)
        if kind is not None:
            if not enable:
                module.__class__ = _plain(module)
                switched += 1
            continue
        if not enable:
            continue
        if _is_gated_mlp(module) and isinstance(getattr(module.gate_proj, "in_features", None), int):
            kind, width = "gated_mlp", module.gate_proj.in_features
        elif _is_rms_norm(module):
            kind, width = "rms_norm", module.weight.shape[0]
        else:
            continue
        if _same_bits(module, _FORWARDS[kind], width):
            module.__class__ = _recomputing(type(module), kind)
            switched += 1
    return switched
