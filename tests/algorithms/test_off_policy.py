"""Off-policy corrections as modules (Score Centering: Marek & Ryabinin 2026, arXiv 2609.20807; StableReinforce:
Tinker's loss; truncated importance sampling): the update's gradient is the written-out formula on a batch whose
sampler is not the learner, the learner's log-probs at recorded ids come from the same forward, and the methods
refuse data that lacks what they read."""

from __future__ import annotations

import dataclasses

import copy
from types import SimpleNamespace

import pytest
import torch

from rl_lightning.algorithms import GRPO, REINFORCE, Advantages, FlashREINFORCE, ScoreCentering, StableReinforce
from rl_lightning.envs import ArithmeticTask
from rl_lightning.rollout import Recording, RolloutBatch, RolloutDataModule, Sampling
from rl_lightning.rollout.generation import position_ids_from_mask
from rl_lightning.models.policy import tiny_llama_config
from tests.rollout.rollout_helpers import fake_trainer
from tests.tolerances import decoder_gradient_tolerance, decoder_logprob_bound

#: gradients of the same loss taken along two float32 paths (chunked closed-form backward vs autograd through a
#: full log_softmax), through the embedded model's backward: decoder_gradient_tolerance relative to the largest
#: entry, for 16 rows of at most 64 positions (3.8e-5 of max|g|; a wrong coefficient moves it by >1e-2)
GRAD_RTOL = float(decoder_gradient_tolerance(tiny_llama_config(64), 64, 16 * 64, 1.0))


def _rollout(module, seed: int = 0, **data) -> RolloutBatch:
    dm = RolloutDataModule(task=ArithmeticTask(num_heldout=4), prompts_per_step=4, group_size=4, seed=seed,
                           sampling=Sampling(max_new_tokens=4), record=Recording(**data))
    dm.trainer = fake_trainer(module)
    return dm.rollout(dm.prompt_batch(0))


def _stale(module) -> None:
    """Move the learner away from the sampler that drew the batch (as a lagged sampler's update would)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))


def _full_logp(module, batch: RolloutBatch) -> torch.Tensor:
    """``[N, T, V]`` the learner's log-probs by one plain forward and a full log_softmax (the naive reference)."""
    out = module.policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=position_ids_from_mask(batch.attention_mask))
    return torch.log_softmax(out.logits[:, batch.prompt_length - 1:-1].float(), dim=-1)


def _grads(module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])


def _module_grad(module, batch: RolloutBatch) -> torch.Tensor:
    module.policy.zero_grad()
    advantages = module.compute_advantages(batch).unsqueeze(-1)
    weights = module.loss_weights(batch)
    out = module.forward_policy(batch, extra_ids=module.extra_logprob_ids(batch))
    loss, _ = module.policy_loss(batch, out, Advantages(advantages), weights)
    loss.backward()
    return _grads(module), advantages, weights


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, atol=GRAD_RTOL * float(b.abs().max())), float((a - b).abs().max())


def test_score_centering_with_a_full_vocabulary_head_is_the_exact_centred_gradient():
    torch.manual_seed(0)
    module = ScoreCentering(model_name_or_path="embedded:random", baseline="batch_mean")
    vocab = module.policy.config.vocab_size
    batch = _rollout(module, topk=vocab)
    _stale(module)
    grad, adv, w = _module_grad(module, batch)
    module.policy.zero_grad()
    logp = _full_logp(module, batch)
    # q: the sampler's distribution (its recorded top-k, here the whole vocabulary)
    q = torch.zeros_like(logp).scatter(-1, batch.record.topk_ids, batch.record.topk_logprobs.exp()).detach()
    m = batch.loss_mask.float()
    sampled = logp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    # the whole vocabulary is the head: ρ = eps/eps = 1, the exact centring -A [log p_a - Σ_v sg(q_v - p_v) log p_v]
    p = logp.exp().detach()
    ((-adv * (sampled - ((q - p) * logp).sum(-1)) * m) * w).sum().backward()
    _close(grad, _grads(module))
    # ... whose logit gradient is -A (e_a - q): the same as the loss -A [log p_a - Σ_v sg(q_v) log p_v]
    module.policy.zero_grad()
    logp = _full_logp(module, batch)
    sampled = logp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    ((-adv * (sampled - (q * logp).sum(-1)) * m) * w).sum().backward()
    _close(grad, _grads(module))


def test_score_centering_with_a_small_head_uses_the_tail_ratio():
    torch.manual_seed(0)
    module = ScoreCentering(model_name_or_path="embedded:random", baseline="batch_mean", importance_cap=2.0)
    batch = _rollout(module, topk=3)
    _stale(module)
    grad, adv, w = _module_grad(module, batch)
    module.policy.zero_grad()
    logp = _full_logp(module, batch)
    head = logp.gather(-1, batch.record.topk_ids)
    p_h, q_h = head.exp().detach(), batch.record.topk_logprobs.exp()
    rho = ((1 - q_h.sum(-1)).clamp_min(1e-6) / (1 - p_h.sum(-1)).clamp_min(1e-6)).unsqueeze(-1)
    rho_w = rho * (1 / rho).clamp(max=2.0)
    r = q_h * (p_h / q_h).clamp(max=2.0) - rho_w * p_h
    sampled = logp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    w_a = (sampled.detach() - batch.sampler_logprobs).exp().clamp(max=2.0)
    m = batch.loss_mask.float()
    ((-adv * (w_a * sampled - (r * head).sum(-1)) * m) * w).sum().backward()
    _close(grad, _grads(module))


def test_stable_reinforce_gradient_is_the_monte_carlo_centred_formula():
    torch.manual_seed(0)
    module = StableReinforce(model_name_or_path="embedded:random", baseline="batch_mean")
    batch = _rollout(module, aux_draws=8)
    _stale(module)
    grad, adv, w = _module_grad(module, batch)
    module.policy.zero_grad()
    logp = _full_logp(module, batch)
    sampled = logp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    aux = logp.gather(-1, batch.record.aux_ids).mean(-1)
    m = batch.loss_mask.float()
    ((-adv * (sampled - aux) * m) * w).sum().backward()
    _close(grad, _grads(module))


def test_the_learner_logprobs_at_recorded_ids_come_from_the_same_forward():
    torch.manual_seed(0)
    module = ScoreCentering(model_name_or_path="embedded:random")
    batch = _rollout(module, topk=4)
    with torch.no_grad():
        out = module.forward_policy(batch, extra_ids=batch.record.topk_ids)
        want = _full_logp(module, batch).gather(-1, batch.record.topk_ids)
    m = batch.loss_mask.bool()
    # on-policy, the learner's log-probs at the sampler's head equal the recorded ones (float32 rounding)
    tol = decoder_logprob_bound(module.policy, batch.temperature, module.policy.config.max_position_embeddings)
    assert torch.allclose(out.extra_logprobs[m], want[m], rtol=0, atol=tol)
    assert torch.allclose(out.extra_logprobs[m], batch.record.topk_logprobs[m], rtol=0, atol=tol)
    assert (out.extra_logprobs[~m] == 0).all()


@pytest.mark.parametrize("cls, setting", [(ScoreCentering, "record.topk"), (StableReinforce, "record.aux_draws")])
def test_a_method_refuses_data_without_what_it_reads(cls, setting):
    module = cls(model_name_or_path="embedded:random")
    with pytest.raises(ValueError, match=f"data.init_args.{setting} >= 1"):
        module.check_datamodule(SimpleNamespace(record=Recording(topk=0, aux_draws=0)))
    module.check_datamodule(SimpleNamespace(record=Recording(topk=8, aux_draws=8)))


@pytest.mark.parametrize("cls", [ScoreCentering, StableReinforce, FlashREINFORCE])
def test_tis_cap_is_refused_where_the_method_has_its_own_weighting(cls):
    with pytest.raises(ValueError, match="tis_cap"):
        cls(model_name_or_path="embedded:random", tis_cap=2.0)


def test_reinforce_with_tis_weights_each_token_by_the_truncated_ratio():
    torch.manual_seed(0)
    module = REINFORCE(model_name_or_path="embedded:random", baseline="batch_mean", tis_cap=1.2)
    batch = _rollout(module)
    _stale(module)
    grad, adv, w = _module_grad(module, batch)
    module.policy.zero_grad()
    sampled = _full_logp(module, batch).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    tis = (sampled.detach() - batch.sampler_logprobs).exp().clamp(max=1.2)
    assert (tis < 1.2).any() and (tis == 1.2).any()  # both branches of the min occur on this batch
    m = batch.loss_mask.float()
    ((-adv * tis * sampled * m) * w).sum().backward()
    _close(grad, _grads(module))


def test_grpo_tis_takes_its_ratio_against_the_learner_before_the_update(monkeypatch):
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random", tis_cap=2.0, num_minibatches=2)
    batch = _rollout(module)
    batch = dataclasses.replace(batch, rewards=torch.rand(batch.num_rows,
                                                          generator=torch.Generator().manual_seed(0)))  # no inert rows
    _stale(module)
    frozen = copy.deepcopy(module.policy)  # the learner before the update
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    original = GRPO.policy_loss

    def spy(self, mb, out, adv, weights):
        with torch.no_grad():
            seen.append((mb.proximal_logprobs, self.forward_policy(mb, model=frozen).logprobs, out.logprobs.detach()))
        return original(self, mb, out, adv, weights)

    monkeypatch.setattr(GRPO, "policy_loss", spy)
    optimizer = torch.optim.SGD(module.policy.parameters(), lr=0.5)
    wrapped = SimpleNamespace(zero_grad=optimizer.zero_grad, step=optimizer.step, optimizer=optimizer)
    monkeypatch.setattr(module, "optimizers", lambda: wrapped)
    monkeypatch.setattr(module, "manual_backward", lambda loss: loss.backward())
    module.update(batch, Advantages(module.compute_advantages(batch).unsqueeze(-1)), module.loss_weights(batch))
    assert len(seen) == 2
    tol = decoder_logprob_bound(module.policy, batch.temperature, module.policy.config.max_position_embeddings)
    for proximal, pre_update, current in seen:  # two forwards of the same weights: float32 rounding
        assert proximal is not None and torch.allclose(proximal, pre_update, rtol=0, atol=tol)
    assert (seen[1][2] - seen[1][0]).abs().max() > tol  # the 2nd minibatch's learner had moved: ratio != 1


def test_grpo_tis_with_one_optimiser_step_needs_no_extra_forward_and_is_the_weighted_gradient():
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random", tis_cap=2.0)
    batch = _rollout(module)
    _stale(module)
    grad, adv, w = _module_grad(module, batch)
    module.policy.zero_grad()
    sampled = _full_logp(module, batch).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    tis = (sampled.detach() - batch.sampler_logprobs).exp().clamp(max=2.0)
    m = batch.loss_mask.float()
    # ρ = π/π_prox = 1 in value, so the clipped surrogate's gradient is tis · A · ∇log π on every token
    ((-adv * tis * (sampled - sampled.detach()).exp() * m) * w).sum().backward()
    _close(grad, _grads(module))
    assert batch.proximal_logprobs is None


def test_a_bf16_sampler_is_a_copy_refreshed_on_its_interval():
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    for interval in (1, 3):
        dm = RolloutDataModule(task=ArithmeticTask(num_heldout=4), prompts_per_step=4, group_size=4,
                               sampling=Sampling(max_new_tokens=4, sync_interval=interval, dtype="bfloat16"))
        dm.trainer = fake_trainer(module)
        first = dm.rollout(dm.prompt_batch(0))
        sampler = dm.sampler()
        assert sampler is not module.policy and next(sampler.parameters()).dtype == torch.bfloat16
        assert next(module.policy.parameters()).dtype == torch.float32
        with torch.no_grad():
            learner = module.forward_policy(first).logprobs
        gap = (learner - first.sampler_logprobs).abs()[first.loss_mask.bool()]
        # bf16 weights and activations (8 mantissa bits): a real gap, far below a lag's
        assert 1e-4 < float(gap.mean()) < 0.1
        with torch.no_grad():
            module.policy.lm_head.weight.add_(0.5)
        dm.rollout(dm.prompt_batch(1))
        refreshed = torch.equal(dm.sampler().lm_head.weight, module.policy.lm_head.weight.to(torch.bfloat16))
        assert refreshed == (interval == 1)
        state = dm.state_dict()
        again = RolloutDataModule(task=ArithmeticTask(num_heldout=4), prompts_per_step=4, group_size=4,
                                  sampling=Sampling(max_new_tokens=4, sync_interval=interval, dtype="bfloat16"))
        again.trainer = fake_trainer(module)
        again.load_state_dict(state)
        assert torch.equal(again.sampler().lm_head.weight, dm.sampler().lm_head.weight)
        assert again.sampler().lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="sampling.dtype"):
        RolloutDataModule(task=ArithmeticTask(num_heldout=4), sampling=Sampling(dtype="float8"))
