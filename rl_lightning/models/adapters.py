"""LoRA adapters on the policy, through ``peft`` (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models", arXiv 2106.09685): ``W x + (α / r) · B A x`` with ``A`` ``[r, in]`` and ``B`` ``[out, r]``, ``B = 0`` at the
start, so the adapted model starts as the base model exactly.

The adapters are injected into the Hugging Face model itself (``peft.inject_adapter_in_model``): the policy stays a
``<Model>ForCausalLM`` with the same attributes (``config``, ``model.layers``, ``lm_head``), so every forward, the
shared-prompt forward and the static decode loop run it unchanged, and only the adapter weights train. What the rest
of the library needs from adapters is here:

* ``add_lora`` -- inject, freeze the base, return the model;
* ``has_adapters`` / ``adapters_disabled`` / ``BaseModelView`` -- the base model under the adapters, with no second
  copy (the reference model of a KL penalty: ``RLModule.load_frozen_copy``);
* ``merged_state_dict`` -- the base model's weights with every adapter merged in, under the base model's names (an
  engine that takes plain weights, an export); ``effective_weight`` -- one projection's weight with its active
  adapters merged (the static decode loop multiplies by it once per token instead of running three products);
* ``frozen_state_keys`` -- the state-dict entries a checkpoint can leave out (the base is reloaded from its path);
* ``add_adapter`` / ``AdapterView`` / ``adapter_parameters`` -- a second set of adapters on the same frozen base (a
  critic's), run alone through a view, trained in a parameter group of its own; the policy's adapter is
  ``POLICY_ADAPTER``, and only it is merged, exported or stepped with the policy (``policy_parameters``).

``peft`` is an optional extra (``pip install -e ".[lora]"``); asking for adapters without it is one line.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from rl_lightning.functional.errors import ConfigError

#: the projections of a Llama-family decoder layer (attention and MLP): LoRA's usual targets
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: the name of the policy's own adapter (peft's default name); other adapters (``add_adapter``) belong to critics
POLICY_ADAPTER = "default"


@dataclass
class LoraSettings:
    """LoRA on the policy (``model.init_args.lora``; ``configs/presets/lora.yaml``).

    Args:
        rank: ``r``, the adapters' inner dimension.
        alpha: ``α``; the update is scaled by ``α / r``.
        dropout: dropout on the adapters' input in training (0: the learner computes what the sampler did; with
            dropout the learner's log-probs are not the sampler's and the shared prompt forward is off).
        target_modules: names of the linear layers that get adapters (a module matches when its name ends with one).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LLAMA_PROJECTIONS))

    def __post_init__(self) -> None:
        problems = [(name, value, rule) for name, value, ok, rule in (
            ("rank", self.rank, isinstance(self.rank, int) and self.rank >= 1, "must be an integer >= 1"),
            ("alpha", self.alpha, self.alpha > 0, "must be > 0"),
            ("dropout", self.dropout, 0 <= self.dropout < 1, "must be in [0, 1)"),
            ("target_modules", self.target_modules, bool(self.target_modules), "must name at least one module"),
        ) if not ok]
        if problems:
            name, value, rule = problems[0]
            raise ConfigError(f"lora.{name}={value!r} {rule}")


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError('lora needs the peft package: pip install -e ".[lora]" (or pip install peft)') from None
    return peft


def peft_config(settings: LoraSettings, base_model_name_or_path: str | None = None) -> Any:
    """The ``peft.LoraConfig`` of ``settings`` (what an adapter export writes as ``adapter_config.json``)."""
    return _peft().LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                              target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM",
                              base_model_name_or_path=base_model_name_or_path)


def add_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze everything else; returns ``model``.

    ``A`` is drawn from the global torch RNG (peft's Kaiming-uniform init), so a seeded run draws the same adapters;
    ``B = 0``, so the adapted model computes what the base model computes until the first update.

    Raises:
        ConfigError: no module of ``model`` matches ``target_modules`` (named with the modules it has).
    """
    peft = _peft()
    linear_names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    if not any(name in linear_names for name in settings.target_modules):
        raise ConfigError(f"lora.target_modules={list(settings.target_modules)} matches no linear layer of the model "
                          f"(its linear layers: {', '.join(linear_names)})")
    model = peft.inject_adapter_in_model(peft_config(settings), model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name)
    model.lora_settings = asdict(settings)  # plain data on the model: an export reads it back
    return model


def is_adapted_linear(module: nn.Module) -> bool:
    """Whether ``module`` is peft's LoRA ``Linear`` over a plain ``nn.Linear`` (what ``add_lora`` puts in place of a
    projection): its forward is the base layer's plus its active adapters' (none while ``adapters_disabled``), so a
    caller that runs it as a projection computes what the model's own forward does. ``False`` for a quantised base
    layer or any other tuner; never imports peft."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    return layer is not None and type(module) is layer.Linear and type(module.base_layer) is nn.Linear


@torch.no_grad()
def effective_weight(module: nn.Module) -> Tensor | None:
    """The weight an adapted projection (``is_adapted_linear``) multiplies by in its forward right now: the base
    weight plus ``(α/r) B A`` of each active adapter (none while ``adapters_disabled``, or once peft has merged them),
    as a new tensor -- so ``F.linear(x, effective_weight(m), m.base_layer.bias)`` is ``m(x)`` up to float rounding
    (one product instead of three). ``None`` where the forward is not such a product: a LoRA variant (DoRA), or
    adapter dropout that is active (training mode with ``p > 0``); the caller then runs ``m`` itself."""
    base = module.base_layer.weight
    if module.disable_adapters or module.merged:
        return base
    weight = base
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        dropout = module.lora_dropout[name]
        variant = name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name, False)
        if variant or (dropout.training and getattr(dropout, "p", 0.0) > 0):
            return None
        weight = weight + module.get_delta_weight(name).to(base.dtype)
    return weight


def _adapter_layers(model: nn.Module) -> list[nn.Module]:
    if not hasattr(model, "lora_settings"):
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters (``add_lora``)."""
    return bool(_adapter_layers(model))


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` as its base model inside the block (peft's ``enable_adapters(False)`` on every adapted layer;
    restored on exit, also on an error). Which parameters require gradients is left as it was (peft's
    ``enable_adapters(True)`` would freeze every adapter but the active one)."""
    layers = _adapter_layers(model)
    before = [layer.disable_adapters for layer in layers]
    flags = _adapter_flags(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer, disabled in zip(layers, before):
            layer.enable_adapters(not disabled)
        _restore(flags)


def _adapter_flags(model: nn.Module) -> list[tuple[nn.Parameter, bool]]:
    return [(p, p.requires_grad) for n, p in model.named_parameters() if ".lora_" in n]


def _restore(flags: list[tuple[nn.Parameter, bool]]) -> None:
    for parameter, flag in flags:
        parameter.requires_grad_(flag)


class BaseModelView(nn.Module):
    """The base model under ``model``'s adapters, as a module: its forward is ``model``'s with the adapters off.

    It shares every weight with ``model`` (no copy: the memory of a second model is saved) and owns none: moving,
    freezing or switching the view's mode leaves ``model`` as it is (the view is held outside the module tree, e.g.
    by a KL callback, and Lightning must not toggle the learner through it). Attributes it does not have (``config``,
    ``model``, ``lm_head``) are ``model``'s.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._target = (model,)  # a tuple: not registered as a submodule
        # the forward shows ``model.forward``'s signature (callers read its keywords, e.g. the cache's name)
        @functools.wraps(model.forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with self.running():
                return model(*args, **kwargs)

        self.forward = forward

    def running(self) -> Any:
        """The context ``model`` runs in for this view's forward: its adapters off."""
        return adapters_disabled(self.target)

    @property
    def target(self) -> nn.Module:
        return self._target[0]

    @property
    def is_activation_checkpointing(self) -> bool:
        return bool(getattr(self.target, "is_activation_checkpointing", False))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._target[0], name)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.target.parameters(recurse)

    def train(self, mode: bool = True) -> BaseModelView:
        return self

    def requires_grad_(self, requires_grad: bool = True) -> BaseModelView:
        return self

    def to(self, *args: Any, **kwargs: Any) -> BaseModelView:
        return self


class AdapterView(BaseModelView):
    """``model`` with only its adapter ``name`` on (``add_adapter``): the frozen base plus that adapter, e.g. a
    critic's, sharing every weight with ``model`` and owning none (as ``BaseModelView``). A forward through it
    back-propagates into adapter ``name`` only; ``model`` run directly stays the policy (``POLICY_ADAPTER``)."""

    def __init__(self, model: nn.Module, name: str) -> None:
        if name not in adapter_names(model):
            raise ConfigError(f"AdapterView: the model has no adapter {name!r} (its adapters: "
                              f"{adapter_names(model)}); add it with add_adapter")
        super().__init__(model)
        self.adapter = name

    def running(self) -> Any:
        return only_adapter(self.target, self.adapter)


def adapter_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s adapters, the policy's (``POLICY_ADAPTER``) first; ``[]`` without adapters."""
    layers = _adapter_layers(model)
    return list(layers[0].lora_A.keys()) if layers else []


def add_adapter(model: nn.Module, name: str) -> None:
    """Add adapters called ``name`` to ``model`` (a policy with LoRA, ``add_lora``) on the layers and with the settings
    of its own; ``B = 0``, so through ``AdapterView(model, name)`` it computes the base model at first. The policy's
    adapter stays the one ``model``'s own forward runs; the new one trains (``adapter_parameters``). ``A`` is drawn
    from the global torch RNG, as in ``add_lora``.

    Raises:
        ConfigError: ``model`` has no adapters (a critic's adapters sit on the policy's frozen base), or already has
            one called ``name``.
    """
    if not has_adapters(model):
        raise ConfigError(f"adapters {name!r} need LoRA on the policy (model.init_args.lora, e.g. "
                          "configs/presets/lora.yaml): they share its frozen base")
    if name in adapter_names(model):
        raise ConfigError(f"the model already has adapters called {name!r}")
    with warnings.catch_warnings():  # peft warns that the model gets a second adapter: that is the point here
        warnings.filterwarnings("ignore", message=".*multiple adapters.*")
        _peft().inject_adapter_in_model(peft_config(LoraSettings(**model.lora_settings)), model, adapter_name=name)
    for layer in _adapter_layers(model):
        layer.set_adapter(POLICY_ADAPTER)  # peft activates the new adapter: the policy's forward stays the policy's
    _restore([(p, True) for p, _ in _adapter_flags(model)])  # set_adapter froze the inactive ones; every adapter trains


def _adapter_key(name: str) -> re.Pattern[str]:
    return re.compile(rf"\.lora_[A-Za-z_]+\.{re.escape(name)}(\.|$)")


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The parameters of ``model``'s adapter ``name``, in ``named_parameters`` order."""
    key = _adapter_key(name)
    return [p for n, p in model.named_parameters() if key.search(n)]


def actor_parameters(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s parameters less those of other adapters than the policy's (``add_adapter``'s, which belong to a
    critic): the actor's weights, frozen ones included (what a critic warm-up freezes)."""
    others = [_adapter_key(name) for name in adapter_names(model) if name != POLICY_ADAPTER]
    if not others:
        return list(model.parameters())
    return [p for n, p in model.named_parameters() if not any(k.search(n) for k in others)]


def policy_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable ``actor_parameters``: what the policy's optimiser group steps."""
    return [p for p in actor_parameters(model) if p.requires_grad]


@contextmanager
def only_adapter(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """Run ``model`` with only its adapter ``name`` on inside the block (restored on exit, also on an error). Which
    parameters require gradients is left as it was, so a backward after the block still reaches the adapter."""
    layers = _adapter_layers(model)
    before = [list(layer.active_adapters) for layer in layers]
    flags = _adapter_flags(model)

    def activate(names: list[list[str]]) -> None:
        for layer, active in zip(layers, names):
            layer.set_adapter(active)
        _restore(flags)  # set_adapter also freezes the inactive adapters: undo that

    activate([[name]] * len(layers))
    try:
        yield model
    finally:
        activate(before)


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s weights with the policy's adapter merged (``W + (α/r) B A``; a critic's adapters are left out),
    under the base model's names; for a model without adapters, its state dict. New tensors: ``model`` is not
    changed."""
    adapted = set(_adapter_layers(model))
    layers = {name: m for name, m in model.named_modules() if m in adapted}
    if not layers:
        return dict(model.state_dict())
    merged: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        owner, _, leaf = key.rpartition(".")
        if owner.endswith(".base_layer") and owner[: -len(".base_layer")] in layers:
            layer_name = owner[: -len(".base_layer")]
            layer = layers[layer_name]
            if leaf == "weight":
                value = value.clone()
                if POLICY_ADAPTER in layer.lora_A:  # the policy's adapter, never a critic's
                    value += layer.get_delta_weight(POLICY_ADAPTER).to(value.dtype)
            key = f"{layer_name}.{leaf}"
        merged[key] = value
    return merged


def adapter_state_dict(model: nn.Module, name: str = POLICY_ADAPTER) -> dict[str, Tensor]:
    """The weights of ``model``'s adapter ``name`` only (by default the policy's), under ``model``'s names."""
    key = _adapter_key(name)
    return {k: v for k, v in model.state_dict().items() if key.search(k)}


def frozen_state_keys(model: nn.Module, prefix: str = "") -> set[str]:
    """The state-dict keys (with ``prefix``) of ``model``'s frozen weights when it carries adapters -- what a
    checkpoint may leave out, since the base is reloaded from its path; empty for a model without adapters."""
    if not has_adapters(model):
        return set()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {prefix + k for k in model.state_dict() if k not in trainable}


def omit_frozen_weights(owner: nn.Module, child: str) -> None:
    """Keep ``owner.<child>``'s frozen base weights out of ``owner``'s state dict (a checkpoint holds the adapters,
    and the optimiser state beside them), and let such a state dict load strictly: the missing base weights are
    the ones ``owner`` already holds (reloaded from their path when it was built). Every other key is still
    checked, so a checkpoint of another model is refused as before."""
    prefix = child + "."

    def drop(module: nn.Module, state: dict[str, Any], prefix_: str, metadata: Any) -> None:
        for key in frozen_state_keys(getattr(module, child), prefix_ + prefix):
            state.pop(key, None)

    def fill(module: nn.Module, state: dict[str, Any], prefix_: str, *args: Any) -> None:
        live = getattr(module, child).state_dict()
        for key in frozen_state_keys(getattr(module, child), prefix_ + prefix):
            state.setdefault(key, live[key[len(prefix_ + prefix):]])

    owner.register_state_dict_post_hook(drop)
    owner.register_load_state_dict_pre_hook(fill)
