"""``check_settings``: the one way a method refuses an invalid constructor argument; ``check_finite``: the one way an
update refuses a non-finite loss or gradient (``NonFiniteLossError``, before any optimiser step); ``check_hook_output``:
the one way the base refuses a hook's output of the wrong shape, naming the hook and the shape it expected (a
``[n]`` objective where ``[n, T]`` belongs would otherwise broadcast, silently when ``n == T``); ``build_optimizer``
and ``clip_gradients``: the optimiser's groups and the gradient clip over them; ``warn_emulated_bf16``: one line
when a CPU run asks for bf16 products the CPU does not compute natively.

Each rule is ``(field, value, valid, rule)``; the first invalid one raises ``ConfigError("<Class>: <field> <rule>,
got <value>")`` (a ``ValueError``), which the CLI reports in one line with the config file and line of the field
(``model.init_args.<field>``) -- from the library's classes and from a user's own alike.
"""

from __future__ import annotations

import difflib
import os
import warnings
from typing import Any, Iterable, Literal

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from rl_lightning.functional.errors import ConfigError


class NonFiniteLossError(FloatingPointError):
    """A loss or gradient was NaN/inf; raised before the optimiser step, so the weights stay finite."""


def check_settings(owner: Any, rules: Iterable[tuple[str, Any, bool, str]], own: bool = False) -> None:
    """Raise for the first rule whose ``valid`` is false (see the module docstring).

    A subclass that gives a parent's setting a wider meaning (CISPO-like "no floor" for a clip its parent bounds)
    names the setting in its class attribute ``relaxed_settings``: the parent's rules for it are then skipped, and
    the subclass checks it itself with ``own=True`` (which checks every rule it is given).
    """
    relaxed = () if own else getattr(type(owner), "relaxed_settings", ())
    for name, value, valid, rule in rules:
        if not valid and name not in relaxed:
            raise ConfigError(f"{type(owner).__name__}: {name} {rule}, got {value!r}")


GradClip = Literal["joint", "per_group"]


def check_module_settings(owner: Any, flags: dict[str, Any], counts: dict[str, Any], micro_batch_size: Any,
                          max_grad_norm: Any, loss_norm_length: Any, loss_aggregation: str,
                          grad_clip: str = "joint") -> None:
    """``RLModule``'s own settings (``check_settings``): ``flags`` true or false, ``counts`` >= 1, a micro-batch
    size and a gradient-norm clip positive or null, the clip's scope, and the constant length normaliser set where
    the aggregation divides by it."""
    check_settings(owner, [(k, v, isinstance(v, bool), "must be true or false") for k, v in flags.items()] + [
        (k, v, v >= 1, "must be >= 1") for k, v in counts.items()] + [
        ("micro_batch_size", micro_batch_size, micro_batch_size is None or micro_batch_size >= 1,
         "must be >= 1 or null"),
        ("max_grad_norm", max_grad_norm, max_grad_norm is None or max_grad_norm > 0, "must be > 0 or null"),
        ("grad_clip", grad_clip, grad_clip in ("joint", "per_group"), "must be joint or per_group"),
        ("loss_norm_length", loss_norm_length,
         (loss_norm_length or 0) >= 1 or loss_aggregation != "seq_mean_token_sum_norm",
         "must be >= 1 with loss_aggregation seq_mean_token_sum_norm (the constant length normaliser)")])


def build_optimizer(factory: Any, groups: list[dict[str, Any]]) -> Any:
    """``factory(groups)``, an optimiser refusing its settings (torch's "Invalid learning rate: -0.0001") refused in
    one line naming the config field."""
    try:
        return factory(groups)
    except (ValueError, TypeError) as err:
        raise ValueError(f"model.init_args.optimizer: the optimiser refused its settings: {err}") from None


def clip_gradients(params: list[nn.Parameter], groups: list[dict[str, Any]], max_norm: float | None,
                   scope: str = "joint") -> tuple[Tensor, dict[str, Tensor]]:
    """Clip gradients in place to ``max_norm`` (``None``: no clip); return the norm of all of them before clipping
    and, with ``scope="per_group"``, each optimiser group's (by the group's ``name``; the first is ``policy``).

    ``joint``: one norm over ``params``, every gradient scaled by ``min(1, max_norm / ‖g‖)`` (torch's
    ``clip_grad_norm_``). ``per_group``: each of ``groups`` clipped by its own norm, as separate optimisers for the
    actor and the critic clip them (verl's and OpenRLHF's actor and critic workers): a critic's large gradient then
    no longer sets the factor the actor's gradient is scaled by (under Adam a constant factor cancels; one that
    varies from step to step reweights the actor's steps). The returned total is ``sqrt(Σ_g ‖g‖²)``, the joint norm
    before clipping.
    """
    limit = float("inf") if max_norm is None else float(max_norm)
    if scope == "joint":
        return _full(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], limit)), {}
    norms: dict[str, Tensor] = {}
    for i, group in enumerate(groups):
        grads = [p for p in group["params"] if p.grad is not None]
        name = group.get("name", "policy" if i == 0 else f"group{i}")
        if grads:
            norms[name if name not in norms else f"{name}{i}"] = _full(torch.nn.utils.clip_grad_norm_(grads, limit))
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms.values()])) if norms else torch.zeros(())
    return total, norms


def _full(norm: Tensor) -> Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP: the global norm


def check_hook_output(owner: Any, hook: str, value: Any, shapes: Iterable[tuple[int, ...]], what: str) -> None:
    """Raise ``ValueError("<Class>.<hook> returned ... ; expected ...")`` unless ``value`` is a tensor of one of
    ``shapes`` (``what`` says what the shape means, e.g. ``"[n, T]: one value per token of the micro-batch"``)."""
    shapes = [tuple(s) for s in shapes]
    got = tuple(value.shape) if isinstance(value, Tensor) else None
    if got not in shapes:
        found = f"a tensor of shape {list(got)}" if got is not None else f"a {type(value).__name__}"
        wanted = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{type(owner).__name__}.{hook} returned {found}; expected {wanted} ({what})")


def check_finite(value: Tensor, what: str, step: int, iteration: int, minibatch: int) -> None:
    """Raise ``NonFiniteLossError`` naming the step, iteration and minibatch if ``value`` is not finite."""
    if not value.isfinite().all():
        raise NonFiniteLossError(
            f"non-finite {what} ({value.item() if value.numel() == 1 else value}) at step {step} "
            f"(iteration {iteration}, minibatch {minibatch}); the weights were not updated")


def warn_misspelt_hooks(cls: type) -> None:
    """Warn when ``cls`` defines a public method whose name is one edit or so from a hook of its bases (the base's
    or Lightning's: ``policy_objectve``): the misspelt method would never be called, and the parent's would run."""
    known = {name for base in cls.__mro__[1:] for name in vars(base) if not name.startswith("_")}
    for name, value in vars(cls).items():
        if name.startswith("_") or name in known or not callable(value):
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.9)
        if close:
            warnings.warn(f"{cls.__qualname__}.{name} is not a hook of {cls.__mro__[1].__name__}; did you mean "
                          f"{close[0]}? (as written it is never called, and the parent's {close[0]} runs)",
                          stacklevel=3)


#: oneDNN instruction-set caps (``ONEDNN_MAX_CPU_ISA``) that keep its native bf16 products
_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10", "ALL", "DEFAULT")


def native_bf16() -> bool:
    """Whether oneDNN multiplies bf16 natively here: the CPU has AVX512-BF16 or AMX, and ``ONEDNN_MAX_CPU_ISA`` (if
    set) does not cap oneDNN below them (under ``AVX512_CORE`` it emulates bf16 with AVX-512, under ``AVX2``
    without)."""
    cpu = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return bool(cpu) and os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper().startswith(_BF16_ISAS)


def warn_emulated_bf16(device: torch.device, precision: str, policy_dtype: str | None,
                       sampler_dtype: str | None) -> str | None:
    """On a CPU without native bf16 products (``native_bf16``), warn in one line, naming the settings, when a run asks
    for bf16 arithmetic: ``trainer.precision`` ``bf16-*``, ``model.init_args.dtype: bfloat16`` or
    ``data.init_args.sampling.dtype: bfloat16``; oneDNN then emulates the products, slower than fp32. Returns the
    warning (``None``: nothing to say)."""
    asked = [name for name, on in (("trainer.precision: " + str(precision), str(precision).startswith("bf16")),
                                   ("model.init_args.dtype: bfloat16", policy_dtype == "bfloat16"),
                                   ("data.init_args.sampling.dtype: bfloat16", sampler_dtype == "bfloat16")) if on]
    if device.type != "cpu" or not asked or native_bf16():
        return None
    message = (f"{', '.join(asked)} on a CPU without native bf16 matrix products (no AVX512-BF16 or AMX for oneDNN): "
               "they are emulated, slower than float32: use float32 on this CPU (configs/presets/cpu-bf16.yaml)")
    warnings.warn(message, stacklevel=2)
    return message


def check_bf16_setup(trainer: Any, policy_dtype: str | None) -> str | None:
    """``warn_emulated_bf16`` for a run: the trainer's device and precision, the policy's dtype, the data module's
    sampler dtype (if it has one)."""
    sampling = getattr(getattr(trainer, "datamodule", None), "sampling", None)
    return warn_emulated_bf16(trainer.strategy.root_device, trainer.precision, policy_dtype,
                              getattr(sampling, "dtype", None))
