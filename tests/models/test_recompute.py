"""``recompute_activations``: the gated MLP's activation and product and the RMS norm's normalised input are saved as
how to rebuild them, and rebuilt in the backward by the forward's own kernels on the same inputs.

So every output and every gradient is compared bit for bit with the model whose modules keep their class forwards
(no tolerance: the same operations on the same numbers). The memory claim is checked on what the hooks replace
(bytes, counted exactly), the safety rules on what they must leave alone.
"""

from __future__ import annotations

import copy
import pickle
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from rl_lightning.models import recompute
from rl_lightning.models.adapters import LoraSettings, add_lora
from rl_lightning.models.policy import build_tiny_policy, load_policy, tiny_llama_config
from rl_lightning.models.recompute import recompute_activations

ROOT = Path(__file__).resolve().parents[2]


def switched(model: nn.Module) -> int:
    return sum(hasattr(type(m), "_recomputes") for m in model.modules())


def pair(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(model switched, a copy with its class forwards)``."""
    recompute_activations(model)
    plain = copy.deepcopy(model)
    recompute_activations(plain, enable=False)
    return model, plain


def tiny(dtype=torch.float32, attention: str = "sdpa") -> nn.Module:
    """A small Llama (two layers, hidden 32, MLP 48): every recomputed module kind, in milliseconds."""
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48)
    config._attn_implementation = attention
    return LlamaForCausalLM(config).to(dtype)


def outputs_and_grads(model: nn.Module, ids: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout draws on both sides
    logits = model(input_ids=ids).logits
    loss = logits.float().log_softmax(-1)[..., 1].sum() + logits.float().pow(2).mean()
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(model: nn.Module, plain: nn.Module, ids: torch.Tensor) -> None:
    out, grads = outputs_and_grads(model, ids)
    out_plain, grads_plain = outputs_and_grads(plain, ids)
    assert torch.equal(out, out_plain)
    assert grads.keys() == grads_plain.keys() and grads
    for name in grads:
        assert torch.equal(grads[name], grads_plain[name]), name


def ids_for(model: nn.Module, rows: int = 3, width: int = 11) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (rows, width), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_and_every_gradient_bit_identical(dtype):
    model, plain = pair(tiny(dtype))
    layers = model.config.num_hidden_layers
    assert switched(model) == layers * 3 + 1  # an MLP and two norms a layer, the final norm
    assert switched(plain) == 0
    assert_same(model, plain, ids_for(model))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_on_every_projection_bit_identical(dropout):
    """LoRA on the down projection (rebuilt product through the adapter) and, with dropout, the product kept."""
    model, plain = pair(tiny())
    settings = LoraSettings(rank=4, alpha=8.0, dropout=dropout, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model, plain = add_lora(model, settings), add_lora(plain, settings)
    plain.load_state_dict(model.state_dict())
    model.train(), plain.train()
    assert switched(model) > 0 and switched(plain) == 0
    assert_same(model, plain, ids_for(model))


def bytes_replaced(model: nn.Module, ids: torch.Tensor, monkeypatch) -> int:
    """The bytes of the saved tensors the hooks replaced by how to rebuild them, in one forward and backward."""
    total = [0]
    original = recompute._Rebuild.__init__

    def counting(self, fn, inputs, saved):
        total[0] += saved.numel() * saved.element_size()
        original(self, fn, inputs, saved)

    monkeypatch.setattr(recompute._Rebuild, "__init__", counting)
    outputs_and_grads(model, ids)
    return total[0]


def test_replaces_the_products_and_normalised_inputs_autograd_keeps(monkeypatch):
    """Every weight trains: per layer the activation and the product (intermediate wide each) and each norm's
    normalised input (hidden wide), all float32, for every position."""
    model = tiny()
    recompute_activations(model)
    ids = ids_for(model, rows=2, width=7)
    config, positions = model.config, 2 * 7
    per_layer = 2 * config.intermediate_size + 2 * config.hidden_size
    expected = 4 * positions * (config.num_hidden_layers * per_layer + config.hidden_size)
    assert bytes_replaced(model, ids, monkeypatch) == expected


def test_frozen_weights_replace_only_what_autograd_would_keep(monkeypatch):
    """Frozen weights (LoRA on the attention only): autograd keeps neither the product for the down projection's
    weight nor the normalised input for the norm's, so only the activation is replaced."""
    model = tiny()
    recompute_activations(model)
    model = add_lora(model, LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"]))
    ids = ids_for(model, rows=2, width=7)
    config = model.config
    assert bytes_replaced(model, ids, monkeypatch) == 4 * 2 * 7 * config.num_hidden_layers * config.intermediate_size


def test_a_forward_without_backward_frees_everything_it_saved(monkeypatch):
    """The hooks hold what autograd would hold and nothing longer: every tensor they saw is freed with the graph
    (an op saving its own output inside a hook would make a cycle that only a backward breaks)."""
    seen: list[weakref.ref] = []
    original = recompute._Recipes.__init__

    def spying(self, *recipes):
        original(self, *recipes)
        pack = self.pack_hook

        def recording(tensor):
            seen.append(weakref.ref(tensor))
            return pack(tensor)

        self.pack_hook = recording

    monkeypatch.setattr(recompute._Recipes, "__init__", spying)
    model = tiny()
    recompute_activations(model)
    logits = model(input_ids=ids_for(model)).logits
    assert seen and any(ref() is not None for ref in seen)
    del logits
    assert all(ref() is None for ref in seen if not isinstance(ref(), nn.Parameter))


def test_double_backward_bit_identical():
    """Under ``create_graph=True`` the rebuilt tensors carry their graph: second derivatives match (eager attention:
    PyTorch's CPU flash attention has no double backward)."""
    model, plain = pair(tiny(attention="eager"))
    ids = ids_for(model)

    def second_order(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids).logits.log_softmax(-1)[..., 1].sum()
        params = [p for p in m.parameters()]
        grads = torch.autograd.grad(loss, params, create_graph=True)
        sum(g.pow(2).sum() for g in grads).backward()
        return [p.grad.clone() for p in params if p.grad is not None]

    ours, theirs = second_order(model), second_order(plain)
    assert len(ours) == len(theirs) and ours
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_gradient_checkpointing_and_no_grad_keep_the_class_forward():
    """Under other saved-tensor hooks (gradient checkpointing) the modules run their class forward: the same bits as
    a checkpointed plain model, no hook mismatch in the recomputation."""
    model, plain = pair(tiny())
    for m in (model, plain):
        m.gradient_checkpointing_enable()
        m.train()
    assert_same(model, plain, ids_for(model))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids_for(model)).logits, plain(input_ids=ids_for(plain)).logits)


def test_survives_train_eval_deepcopy_and_pickle_and_switches_back():
    """Hugging Face's kernel layer resets instance forwards on ``train()``/``eval()``; the switch is a subclass."""
    model = tiny()
    count = recompute_activations(model)
    model.train(), model.eval(), model.train()
    assert switched(model) == count
    for again in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert switched(again) == count
        assert_same(again, model, ids_for(model))
    norm = model.model.norm
    assert type(norm).__name__ == "LlamaRMSNorm" and isinstance(norm, type(norm).__mro__[1])
    assert recompute_activations(model, enable=False) == count and switched(model) == 0
    assert recompute_activations(model) == count  # idempotent both ways
    assert recompute_activations(model) == 0


class ShiftedRMSNorm(nn.Module):
    """An RMS norm whose forward is not Llama's (Gemma's ``1 + weight``): the probe must refuse it."""

    def __init__(self, width: int):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.randn(width)), 1e-6

    def forward(self, x):
        x32 = x.float()
        return (1 + self.weight) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class GeluMLP(nn.Module):
    """A gated MLP with another activation and Llama's forward: switched, the same bits."""

    def __init__(self, width: int = 8, inner: int = 12):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(width, inner), nn.Linear(width, inner)
        self.down_proj, self.act_fn = nn.Linear(inner, width), nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_probe_refuses_a_different_forward_and_accepts_another_activation():
    torch.manual_seed(0)
    model = nn.Sequential(ShiftedRMSNorm(8), GeluMLP())
    assert recompute_activations(model) == 1
    assert type(model[0]) is ShiftedRMSNorm and hasattr(type(model[1]), "_recomputes")
    plain = copy.deepcopy(model)
    recompute_activations(plain, enable=False)
    x = torch.randn(2, 5, 8)
    for m in (model, plain):
        m.zero_grad()
        m(x).pow(2).sum().backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_load_policy_switches_the_embedded_and_saved_models(tmp_path):
    model, _ = load_policy("embedded:arithmetic")
    assert switched(model) == model.config.num_hidden_layers * 3 + 1
    tiny_model, tokenizer = build_tiny_policy()
    tiny_model.save_pretrained(tmp_path), tokenizer.save_pretrained(tmp_path)
    loaded, _ = load_policy(str(tmp_path))
    assert switched(loaded) == loaded.config.num_hidden_layers * 3 + 1
    saved = tmp_path / "export"
    loaded.save_pretrained(saved)  # an export is an ordinary checkpoint: the classes are Hugging Face's
    again = LlamaForCausalLM.from_pretrained(saved)
    assert switched(again) == 0


def test_a_tiny_fit_is_bit_identical_with_and_without(tmp_path, monkeypatch):
    """The shipped default config, 3 steps on the command line: the same parameters, bit for bit."""
    from rl_lightning.cli import build_cli
    from rl_lightning.models import policy
    from rl_lightning.testing import parameter_digest

    def fit(name: str, run: bool = True):
        torch.manual_seed(0)
        args = ["--config", str(ROOT / "configs" / "grpo.yaml"), "--trainer.max_steps", "3",
                "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
                "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
                "--trainer.default_root_dir", str(tmp_path / name)]
        return build_cli(["fit", *args] if run else args, run=run).model

    monkeypatch.chdir(tmp_path)
    ours = fit("on")
    assert switched(ours.policy) > 0
    monkeypatch.setattr(policy, "recompute_activations", lambda model: 0)
    theirs = fit("off")
    assert switched(theirs.policy) == 0
    assert ours.global_step == theirs.global_step == 3
    assert parameter_digest(ours) == parameter_digest(theirs) != parameter_digest(fit("start", run=False))
