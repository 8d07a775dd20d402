"""LoRA adapters through peft (``models.adapters``, ``RLModule(lora=...)``, ``configs/presets/lora.yaml``): the policy
starts as its base exactly, only the adapters train, the sampler generates with them (built-in engine, bound and
lagged), the KL reference is the base with them off (no second copy), checkpoints hold the adapters only and resume
bit-identically, and the merged weights are the adapted model's."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from rl_lightning import ConfigError
from rl_lightning.algorithms import GRPO, PPO
from rl_lightning.callbacks import CriticWarmup, KLRegularizer
from rl_lightning.models.adapters import (
    AdapterView, BaseModelView, LoraSettings, adapter_names, adapter_parameters, adapter_state_dict, add_adapter,
    add_lora, adapters_disabled, effective_weight, merged_state_dict, only_adapter, policy_parameters,
)
from rl_lightning.models.policy import load_policy
from rl_lightning.rollout import static_decode
from tests.conftest import RecordBatches, RecordRollouts, tiny_datamodule, tiny_trainer
from tests.tolerances import decoder_logprob_bound, gamma, unit_roundoff

LORA = LoraSettings(rank=4, alpha=8.0)


def _module(fused: bool | None = None, **kwargs) -> GRPO:  # noqa: ANN003
    torch.manual_seed(0)
    return GRPO(model_name_or_path="embedded:arithmetic", lora=LORA,
                optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, fused=fused), **kwargs)


def _perturb(model: torch.nn.Module) -> None:
    """Nonzero B matrices (as after training), so that the adapters change what the model computes."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_the_adapted_policy_starts_as_its_base_and_only_the_adapters_train():
    module = _module()
    base, _ = load_policy("embedded:arithmetic")
    ids = torch.randint(3, 90, (3, 9), generator=torch.Generator().manual_seed(0))
    # B = 0: the adapters add exact zeros, so the logits are the base model's bit for bit
    assert torch.equal(module.policy(input_ids=ids).logits, base(input_ids=ids).logits)
    trainable = [n for n, p in module.policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert len(trainable) == 2 * 7 * 4  # A and B of 7 projections in each of 4 layers
    (group,) = module.parameter_groups()
    assert {id(p) for p in group["params"]} == {id(p) for p in module.trainable_parameters()}
    assert sum(p.numel() for p in group["params"]) == sum(p.numel() for n, p in module.policy.named_parameters()
                                                          if ".lora_" in n)


def test_settings_are_checked_in_one_line():
    with pytest.raises(ConfigError, match=r"lora.rank=0 must be an integer >= 1"):
        LoraSettings(rank=0)
    with pytest.raises(ConfigError, match=r"lora.dropout=1.0 must be in \[0, 1\)"):
        LoraSettings(dropout=1.0)
    model, _ = load_policy("embedded:arithmetic")
    with pytest.raises(ConfigError, match=r"matches no linear layer of the model \(its linear layers: .*q_proj"):
        add_lora(model, LoraSettings(target_modules=["query_key_value"]))


def test_the_base_view_is_the_base_model_without_a_copy():
    module = _module()
    _perturb(module.policy)
    base, _ = load_policy("embedded:arithmetic")
    view = module.load_frozen_copy()
    assert isinstance(view, BaseModelView) and list(view.named_parameters(recurse=True)) == []  # owns nothing
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    adapted = module.policy(input_ids=ids).logits
    assert torch.equal(view(input_ids=ids).logits, base(input_ids=ids).logits)  # same operations: bitwise
    assert not torch.equal(adapted, base(input_ids=ids).logits)  # the adapters matter here
    assert torch.equal(module.policy(input_ids=ids).logits, adapted)  # switched back on after the view's forward
    view.eval().requires_grad_(False)  # the view's mode and grad flags are not the learner's
    assert module.policy.training and any(p.requires_grad for p in module.policy.parameters())
    with pytest.raises(RuntimeError, match="boom"), adapters_disabled(module.policy):
        raise RuntimeError("boom")
    assert torch.equal(module.policy(input_ids=ids).logits, adapted)  # restored after an error too


def test_a_second_adapter_runs_alone_on_the_shared_base_and_is_never_the_policys():
    """``add_adapter`` (a critic's adapters): through its ``AdapterView`` the model is the base plus that adapter only
    (the base exactly while its B is 0; the policy's adapter plays no part); the model's own forward, its merged
    weights, its adapter export and its policy parameters stay the policy's; the base view turns both off."""
    module = _module()
    _perturb(module.policy)
    policy = module.policy
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    adapted, merged = policy(input_ids=ids).logits, merged_state_dict(policy)
    add_adapter(policy, "critic")
    assert adapter_names(policy) == ["default", "critic"]
    base, _ = load_policy("embedded:arithmetic")
    view = AdapterView(policy, "critic")
    assert list(view.named_parameters()) == []  # owns nothing
    assert torch.equal(view(input_ids=ids).logits, base(input_ids=ids).logits)  # B = 0 and the policy's adapter off
    assert torch.equal(policy(input_ids=ids).logits, adapted)  # the policy's forward is the policy's
    critic = adapter_parameters(policy, "critic")
    assert len(critic) == 2 * 7 * 4 and all(p.requires_grad for p in critic)
    assert not {id(p) for p in critic} & {id(p) for p in policy_parameters(policy)}
    assert len(policy_parameters(policy)) == 2 * 7 * 4
    with torch.no_grad():
        for p in critic:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    assert not torch.equal(view(input_ids=ids).logits, base(input_ids=ids).logits)  # now the critic's adapter acts
    assert torch.equal(policy(input_ids=ids).logits, adapted)
    assert torch.equal(module.load_frozen_copy()(input_ids=ids).logits, base(input_ids=ids).logits)  # both off
    again = merged_state_dict(policy)
    assert again.keys() == merged.keys() and all(torch.equal(again[k], merged[k]) for k in merged)
    assert adapter_state_dict(policy) and all(".default." in k for k in adapter_state_dict(policy))
    assert all(".critic." in k for k in adapter_state_dict(policy, "critic"))
    view(input_ids=ids).logits.sum().backward()  # a backward through the view reaches the critic's adapter only
    assert all(p.grad is not None for p in critic) and all(p.grad is None for p in policy_parameters(policy))
    with pytest.raises(RuntimeError, match="boom"), only_adapter(policy, "critic"):
        raise RuntimeError("boom")
    assert torch.equal(policy(input_ids=ids).logits, adapted)  # restored after an error too
    assert all(p.requires_grad for p in critic) and all(p.requires_grad for p in policy_parameters(policy))
    with pytest.raises(ConfigError, match="already has adapters called 'critic'"):
        add_adapter(policy, "critic")
    with pytest.raises(ConfigError, match="has no adapter 'judge'"):
        AdapterView(policy, "judge")
    with pytest.raises(ConfigError, match=r"need LoRA on the policy \(model.init_args.lora"):
        add_adapter(base, "critic")


def test_merged_weights_compute_what_the_adapted_model_computes():
    """In float64 the adapted model (``W x + s B A x``) and the merged one (``(W + s B A) x``) differ by rounding
    of order ``2^-53`` times the terms: 1e-9 is far above that and far below the effect of a wrong merge."""
    module = _module()
    _perturb(module.policy)
    adapted = module.policy.double()
    merged = merged_state_dict(adapted)  # merged in float64 too
    base, _ = load_policy("embedded:arithmetic")
    base = base.double()
    assert set(merged) == set(base.state_dict())  # the base model's names, no adapter left
    base.load_state_dict(merged)
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    diff = (adapted(input_ids=ids).logits - base(input_ids=ids).logits).abs().max()
    assert diff < 1e-9, diff
    assert adapter_state_dict(module.policy) and all(".lora_" in k for k in adapter_state_dict(module.policy))


def _merge_case() -> tuple[GRPO, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A policy with trained-looking adapters, its first q projection, and that projection's exact merged weight
    ``W + (α/r) B A`` (float64) with the magnitudes the float32 sum of r products and one add rounds."""
    module = _module()
    _perturb(module.policy)
    layer = module.policy.model.layers[0].self_attn.q_proj
    w, a, b = (layer.base_layer.weight.double(), layer.lora_A["default"].weight.double(),
               layer.lora_B["default"].weight.double())
    scale = LORA.alpha / LORA.rank
    return module, layer, w + scale * b @ a, w.abs() + scale * b.abs() @ a.abs()


def test_a_merged_weight_is_w_plus_scaled_b_a_within_float32_rounding():
    module, _, exact, terms = _merge_case()
    got = merged_state_dict(module.policy)["model.layers.0.self_attn.q_proj.weight"].double()
    assert ((got - exact).abs() <= gamma(LORA.rank + 2) * terms + unit_roundoff()).all()


def test_an_effective_weight_is_the_active_adapters_merged_and_none_where_the_forward_is_not_a_product():
    """``effective_weight``: W + (α/r) B A within the merge's float32 bound while the adapters are on, W itself
    while they are disabled, and ``None`` (run the layer's own forward) with active adapter dropout or a variant."""
    module, layer, exact, terms = _merge_case()
    got = effective_weight(layer)
    assert not got.requires_grad
    assert ((got.double() - exact).abs() <= gamma(LORA.rank + 2) * terms + unit_roundoff()).all()
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(2))
    # both products approximate (W + (α/r) B A) x, each within γ(in + r + 2) of |W| |x| + (α/r) |B| |A| |x|
    bound = 2 * gamma(layer.in_features + LORA.rank + 2) * x.double().abs() @ terms.T
    with torch.no_grad():
        diff = (torch.nn.functional.linear(x, got, layer.base_layer.bias) - layer(x)).double().abs()
    assert (diff <= bound).all()
    with adapters_disabled(module.policy):
        assert effective_weight(layer) is layer.base_layer.weight
    dropping = add_lora(load_policy("embedded:arithmetic")[0], LoraSettings(rank=4, alpha=8.0, dropout=0.1))
    projection = dropping.model.layers[0].self_attn.q_proj
    assert effective_weight(projection.train()) is None  # dropout draws a mask per call: no single weight
    assert effective_weight(projection.eval()) is not None
    projection.use_dora = {"default": True}  # a variant's forward is not W' x either (the attribute peft sets)
    assert effective_weight(projection) is None


@pytest.mark.parametrize("merge_min_steps", [10**9, 0], ids=["through-adapters", "merged-weights"])
def test_the_sampler_generates_with_the_adapters_after_updates_and_syncs(tmp_path, monkeypatch, merge_min_steps):
    """``train/sampler_logp_diff`` (sampler vs learner log-probs of the sampled tokens) within the float32 bound at
    every step, after updates have made the adapters matter, for the engine bound to the policy and for a lagged
    copy synced every 2 steps (steps 0 and 2 are right after a sync), with the decode step running the adapters and
    with it multiplying by merged effective weights (``static_decode.MERGE_MIN_STEPS``). The base model's log-probs
    are far outside the bound (the negative control: a sampler that dropped the adapters would fail)."""
    monkeypatch.setattr(static_decode, "MERGE_MIN_STEPS", merge_min_steps)
    for interval, steps in ((1, 3), (2, 3)):
        module, record = _module(), RecordBatches()
        dm = tiny_datamodule(sync_interval=interval)
        tiny_trainer(tmp_path / f"i{interval}", max_steps=steps, callbacks=[record]).fit(module, datamodule=dm)
        bound = decoder_logprob_bound(module.policy, 1.0, module.policy.config.max_position_embeddings)
        synced = [s for s in range(steps) if s % interval == 0]
        diffs = [record.metrics[s]["train/sampler_logp_diff"] for s in synced]
        assert all(d <= bound for d in diffs), (interval, diffs, bound)
        assert any(float(p.detach().abs().max()) > 0 for n, p in module.policy.named_parameters() if ".lora_B." in n)
    batch = record.batches[-1]
    with torch.no_grad():
        adapted = module.token_logprobs(batch)[0]
        base = module.token_logprobs(batch, model=module.load_frozen_copy())[0]
    assert float(((adapted - base) * batch.loss_mask).abs().max()) > 100 * bound


def test_kl_to_the_base_is_zero_at_the_start_and_needs_no_second_model(tmp_path):
    module, record, kl = _module(), RecordRollouts(), KLRegularizer(beta=0.1)
    tiny_trainer(tmp_path, max_steps=2, callbacks=[record, kl]).fit(module, datamodule=tiny_datamodule())
    assert isinstance(kl.reference, BaseModelView) and kl.reference.target is module.policy
    assert record.metrics[0]["train/kl"] == 0.0  # B = 0 before the first update: the same computation
    assert record.metrics[1]["train/kl"] > 0.0


@pytest.mark.parametrize("fused", [None, True], ids=["adamw-loop", "adamw-fused"])
def test_checkpoints_hold_the_adapters_only_and_resume_bit_identically(tmp_path, fused):
    """Also with AdamW's fused kernel (configs/grpo_smollm2.yaml's), whose state is restored as the loop's."""
    straight = _module(fused)
    tiny_trainer(tmp_path / "a", max_steps=3).fit(straight, datamodule=tiny_datamodule())
    first = _module(fused)
    trainer = tiny_trainer(tmp_path / "b", max_steps=2)
    trainer.fit(first, datamodule=tiny_datamodule())
    path = tmp_path / "b.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    assert state and all(".lora_" in k for k in state)  # no base weight in the file
    assert state.keys() == {f"policy.{k}" for k in adapter_state_dict(first.policy)}
    resumed = _module(fused)
    tiny_trainer(tmp_path / "c", max_steps=3).fit(resumed, datamodule=tiny_datamodule(), ckpt_path=str(path))
    assert all(group.get("fused") == fused for group in resumed.optimizers().optimizer.param_groups)
    for (name, a), (_, b) in zip(straight.policy.named_parameters(), resumed.policy.named_parameters()):
        assert torch.equal(a, b), name


def _ppo_with_adapter_critic() -> PPO:
    torch.manual_seed(0)
    return PPO(model_name_or_path="embedded:arithmetic", lora=LORA, critic="adapter",
               optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))


def test_a_value_critic_on_adapters_of_its_own_trains_them_alone_and_resumes_bit_identically(tmp_path):
    """PPO(critic="adapter") on a LoRA policy: the critic is its head plus adapters of its own on the frozen base
    (one model in memory). The optimiser groups are disjoint; a critic warm-up step moves the critic's adapters and
    head but not the policy's adapter; later steps move both; the checkpoint holds every adapter and the head, and a
    resume is bit-identical to the straight run."""
    module = _ppo_with_adapter_critic()
    critic_adapters = adapter_parameters(module.policy, "critic")
    assert len(critic_adapters) == 2 * 7 * 4
    assert len(module.critic.named_trainable()) == 2 + len(critic_adapters)  # the head's weight and bias
    policy_group, critic_group = module.parameter_groups()
    assert not {id(p) for p in policy_group["params"]} & {id(p) for p in critic_group["params"]}
    trainable = [id(p) for p in module.trainable_parameters() if p.requires_grad]  # the frozen base is listed too
    assert len(trainable) == len(set(trainable)) == len(policy_group["params"]) + len(critic_group["params"])

    def snapshot(params):  # noqa: ANN001, ANN202
        return [p.detach().clone() for p in params]

    policy0, critic0 = snapshot(policy_group["params"]), snapshot(critic_group["params"])

    class AfterStep(Callback):
        def __init__(self) -> None:
            self.policy, self.critic = [], []

        def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
            self.policy.append(snapshot(policy_group["params"]))
            self.critic.append(snapshot(critic_group["params"]))

    steps = AfterStep()
    tiny_trainer(tmp_path / "a", max_steps=3, callbacks=[CriticWarmup(1), steps]).fit(
        module, datamodule=tiny_datamodule())
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    assert same(steps.policy[0], policy0) and not same(steps.critic[0], critic0)  # warm-up: the critic alone
    assert not same(steps.policy[2], policy0) and not same(steps.critic[2], steps.critic[1])
    assert all(p.requires_grad for p in critic_adapters)  # every flag restored after the warm-up

    first = _ppo_with_adapter_critic()
    trainer = tiny_trainer(tmp_path / "b", max_steps=2, callbacks=[CriticWarmup(1)])
    trainer.fit(first, datamodule=tiny_datamodule())
    path = tmp_path / "b.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    assert {k for k in state if ".lora_" not in k} == {"critic.head.proj.weight", "critic.head.proj.bias"}
    assert any(".lora_A.critic." in k for k in state) and any(".lora_A.default." in k for k in state)
    resumed = _ppo_with_adapter_critic()
    tiny_trainer(tmp_path / "c", max_steps=3, callbacks=[CriticWarmup(1)]).fit(
        resumed, datamodule=tiny_datamodule(), ckpt_path=str(path))
    for a, b in zip(module.trainable_parameters(), resumed.trainable_parameters()):
        assert torch.equal(a, b)
