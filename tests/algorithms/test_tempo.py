"""TEMPO (no public paper: docs/algorithms.md, TEMPO) on real guess-the-number branches: every branch terminal
within H gives the Monte-Carlo return with no critic call; cut branches bootstrap with the critic's value of their
end state; y(s) is the branch mean; the critic's rewards are centred per state; warm-up, replay and refusals; a
CLI fit past the warm-up resumes bitwise."""

from __future__ import annotations

import hashlib

import pytest
import torch

from rl_lightning.algorithms import TEMPO
from rl_lightning.callbacks import StepCheckpoint
from rl_lightning.algorithms.generative_critic import ADVANTAGE, BIN, GenerativeCritic, end_history
from rl_lightning.algorithms.tempo import QUERIED, REPLAYED, RETURN, TARGET
from rl_lightning.cli import build_cli
from rl_lightning.envs import GuessNumberTask
from rl_lightning.functional import group_advantages, nearest_bin
from rl_lightning.rollout import Branch, BranchRollout, Evaluation, GroupRollout, RolloutDataModule, Sampling
from tests.conftest import REPO
from tests.rollout.rollout_helpers import fake_trainer


class CountingCritic(GenerativeCritic):
    """Counts every forward the critic makes (``logprobs``), not only ``values``."""

    forwards = 0

    def logprobs(self, module, contexts):  # noqa: ANN001
        self.forwards += len(contexts)
        return super().logprobs(module, contexts)


def setup(horizon: int, warmup_steps: int = 0, replay: int = 0, **kwargs) -> tuple[TEMPO, RolloutDataModule]:
    torch.manual_seed(0)
    module = TEMPO(model_name_or_path="embedded:guess", critic=CountingCritic(), horizon=horizon,
                   warmup_steps=warmup_steps, replay=replay, **kwargs)
    dm = RolloutDataModule(task=GuessNumberTask(), prompts_per_step=4, group_size=4,
                           strategy=BranchRollout(n=4, max_turns=5, max_episode_tokens=32), seed=0,
                           sampling=Sampling(max_new_tokens=3), evaluation=Evaluation(batch_size=31))
    dm.trainer = fake_trainer(module)
    module.check_datamodule(dm)
    return module, dm


def test_branches_terminal_within_the_horizon_give_the_monte_carlo_return_and_never_call_the_critic():
    module, dm = setup(horizon=5)  # TD phase, H = the whole episode: every branch terminates
    batch = dm.rollout(dm.prompt_batch(0))
    assert bool(batch.ends.terminated.all()) and batch.rewards.std() > 0
    adv = module.compute_advantages(batch)
    torch.testing.assert_close(adv.rows[RETURN], batch.rewards)  # G_i = the episode's return
    assert module.critic.calls == 0 and module.critic.forwards == 0 and float(adv.rows[QUERIED].sum()) == 0
    mean = batch.rewards.view(-1, 4).mean(dim=1).repeat_interleave(4)
    torch.testing.assert_close(adv.rows[TARGET], mean)  # y(s): the branch mean
    torch.testing.assert_close(adv.advantages, group_advantages(batch.rewards, 4))


def test_cut_branches_bootstrap_with_the_detached_critic_value_of_their_end_state():
    module, dm = setup(horizon=3)
    batch = dm.rollout(dm.prompt_batch(0))
    cut = batch.ends.cut
    assert 0 < int(cut.sum()) < batch.num_rows  # 2 of 16 found it within 3 guesses, 14 were cut
    adv = module.compute_advantages(batch)
    assert module.critic.calls == int(cut.sum())  # one query per cut branch, none at terminated ends
    contexts = [module.critic.context(module, end_history(batch, r), batch.prompts[r])
                for r in cut.nonzero().flatten().tolist()]
    assert all(len(c) <= 63 for c in contexts)
    ends = module.critic.values(module, contexts)
    expected = batch.rewards.clone()
    expected[cut] += ends
    torch.testing.assert_close(adv.rows[RETURN], expected)
    torch.testing.assert_close(adv.rows[TARGET], expected.view(-1, 4).mean(dim=1).repeat_interleave(4))
    assert not adv.rows[RETURN].requires_grad
    # the end state's history is the whole row and the observation the horizon kept out ("hi:" / "lo:")
    row = int(cut.nonzero()[0])
    text = module.tokenizer.decode(end_history(batch, row), skip_special_tokens=False)
    assert text.startswith("<bos>guess 1-31:") and text.endswith(("hi:", "lo:", "bad:"))
    # the cut ends are kept for replay with the horizon and the rest of the episode's budget
    assert len(module.store) == int(cut.sum())
    saved = module.store.items[0]
    assert saved.max_turns == 3 and saved.max_tokens == 32 - len(saved.prefix_ids)


def test_the_critic_rows_are_rewarded_by_accuracy_centred_within_each_states_group():
    module, dm = setup(horizon=1, critic_samples=3)
    batch = dm.rollout(dm.prompt_batch(0))
    adv = module.compute_advantages(batch)
    (rows,) = module.auxiliary_rows(batch, adv)
    assert rows.batch.num_rows == 4 * 3  # 3 value tokens per starting state
    a = rows.batch.extras[ADVANTAGE].view(4, 3)
    torch.testing.assert_close(a.sum(dim=1), torch.zeros(4), atol=1e-6, rtol=0)
    y = adv.rows[TARGET][::4]
    reward = -(module.critic.levels()[rows.batch.extras[BIN]].view(4, 3) - y.unsqueeze(1)).abs()
    torch.testing.assert_close(a, reward - reward.mean(dim=1, keepdim=True))
    stats = rows.metrics  # logged with the update's metrics (AuxiliaryRows.metrics)
    assert set(stats) == {"train/critic_value", "train/critic_value_std", "train/critic_error", "train/critic_reward"}
    values = module.critic.values(module, module.critic.start_contexts(module, batch)[1])
    torch.testing.assert_close(stats["train/critic_value_std"][0], values.std(unbiased=False).to(torch.float32),
                               rtol=1e-5, atol=1e-6)
    # the critic's context is the starting state's history (here the first observation) and the query
    text = module.tokenizer.decode(rows.batch.input_ids[0][rows.batch.attention_mask[0].bool()][:-1].tolist(),
                                   skip_special_tokens=False)
    assert text == "<bos>guess 1-31: V:"


def test_warm_up_runs_whole_episodes_then_the_horizon_with_replayed_states():
    module, dm = setup(horizon=2, warmup_steps=3, replay=2)
    prompts = dm.prompt_batch(0)
    assert all(b.max_turns is None for b in module.branches(2, prompts))  # warm-up: to the episode's end
    batch = dm.rollout(prompts)
    module.compute_advantages(batch)  # global_step 0 < 3: Monte-Carlo, nothing stored, no query
    assert module.critic.forwards == 0 and len(module.store) == 0
    saved = Branch(prompts.prompts[0], module.tokenizer("16", add_special_tokens=False)["input_ids"], prompt_index=0)
    module.store.add([saved])  # a saved state: a prefix to continue from
    after = module.branches(3, prompts)
    assert len(after) == 5 and all(b.max_turns == 2 for b in after) and after[4].prefix_ids == saved.prefix_ids
    # the batch says which rows continue a saved state (BRANCH_PREFIX_TOKENS), and TEMPO counts them as replayed
    rows = dm.rollout_branches(after, n=4)
    adv = module.compute_advantages(rows)
    assert adv.rows[REPLAYED].tolist() == [0.0] * 16 + [1.0] * 4


def test_refusals():
    module, _ = setup(horizon=1)
    plain = RolloutDataModule(task=GuessNumberTask(), prompts_per_step=2, group_size=4,
                              strategy=GroupRollout(max_turns=5), sampling=Sampling(max_new_tokens=3))
    with pytest.raises(ValueError, match="data.init_args.strategy must be a rl_lightning.rollout.BranchRollout"):
        module.check_datamodule(plain)
    with pytest.raises(ValueError, match="critic_samples must be >= 2"):
        TEMPO(model_name_or_path="embedded:guess", critic_samples=1)
    with pytest.raises(ValueError, match="critic_loss must be"):
        TEMPO(model_name_or_path="embedded:guess", critic_loss="mse")


def _fit(root, steps: int, ckpt_path: str | None = None) -> str:
    torch.manual_seed(0)
    cli = build_cli(["--config", str(REPO / "configs" / "tempo.yaml"), f"--trainer.max_steps={steps}",
                     f"--trainer.default_root_dir={root}", "--trainer.logger=false", "--trainer.limit_val_batches=0",
                     "--trainer.enable_progress_bar=false", "--model.init_args.warmup_steps=1",
                     "--model.init_args.replay=2", "--data.init_args.prompts_per_step=2"], run=False, save_config=False)
    for cb in [cb for cb in cli.trainer.callbacks if isinstance(cb, StepCheckpoint)]:
        cli.trainer.callbacks.remove(cb)
    cli.trainer.callbacks.append(StepCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    digest = hashlib.sha256()
    for param in cli.model.parameters():
        digest.update(param.detach().numpy().tobytes())
    return digest.hexdigest() + f"/store={len(cli.model.store)}"


def test_a_fit_past_the_warm_up_with_replayed_states_resumes_bitwise(tmp_path):
    straight = _fit(tmp_path / "a", 3)  # step 0 warm-up; steps 1, 2 TD, step 2 replays step 1's cut ends
    step2 = sorted((tmp_path / "a" / "ckpt").glob("*step=2.ckpt"))
    assert step2
    assert _fit(tmp_path / "b", 3, ckpt_path=str(step2[0])) == straight


def test_the_cross_entropy_critic_trains_the_nearest_bin_of_each_states_target():
    module, dm = setup(horizon=3, critic_loss="ce")
    batch = dm.rollout(dm.prompt_batch(0))
    adv = module.compute_advantages(batch)
    (rows,) = module.auxiliary_rows(batch, adv)
    assert rows.batch.num_rows == 4  # one row per starting state
    assert rows.batch.extras[BIN].tolist() == nearest_bin(adv.rows[TARGET][::4], module.critic.levels()).tolist()
    assert set(rows.metrics) == {"train/critic_value", "train/critic_value_std", "train/critic_error"}


def test_a_critic_on_weights_of_its_own_trains_them_and_leaves_the_policy_alone():
    """GenerativeCritic(weights="own"): the critic's rows back-propagate into its copy of the warm start only, its
    values are read from that copy, it is optimised and checkpointed with the module; shared: into the policy."""
    from rl_lightning.algorithms.auxiliary import run_auxiliary
    from rl_lightning.algorithms.metrics import UpdateMetrics

    own = TEMPO(model_name_or_path="embedded:guess", critic=GenerativeCritic(weights="own"))
    own.manual_backward = lambda loss: loss.backward()  # what run_auxiliary calls, without a Trainer
    assert own.critic_model is not None and own.critic_model is not own.policy
    assert all(torch.equal(a, b) for a, b in zip(own.critic_model.parameters(), own.policy.parameters()))
    assert any(k.startswith("critic_model.") for k in own.state_dict())
    groups = own.parameter_groups()
    assert [g.get("name") for g in groups] == [None, "critic"]
    assert len(own.trainable_parameters()) == 2 * len(list(own.policy.parameters()))
    contexts = [own.critic.context(own, own.tokenizer("guess 1-31:5")["input_ids"])]
    rows = own.critic.ce_rows(own, contexts, torch.tensor([1.0]))
    assert rows.model is own.critic_model
    run_auxiliary(own, [(rows, torch.arange(1), 1.0)], UpdateMetrics(), 0, 0)
    assert all(p.grad is None for p in own.policy.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in own.critic_model.parameters())
    before = own.critic.values(own, contexts)
    with torch.no_grad():
        for p in own.critic_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert not torch.equal(own.critic.values(own, contexts), before)  # read from its own weights
    shared = TEMPO(model_name_or_path="embedded:guess")
    shared.manual_backward = lambda loss: loss.backward()
    assert shared.critic_model is None and len(shared.parameter_groups()) == 1
    rows = shared.critic.ce_rows(shared, contexts, torch.tensor([1.0]))
    run_auxiliary(shared, [(rows, torch.arange(1), 1.0)], UpdateMetrics(), 0, 0)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in shared.policy.parameters())
    with pytest.raises(ValueError, match="never given its weights"):
        GenerativeCritic(weights="own").values(shared, contexts)


def test_a_critic_on_adapters_of_its_own_trains_them_and_leaves_the_policy_alone():
    """GenerativeCritic(weights="adapter") on a LoRA policy: the critic's rows back-propagate into its adapters only
    (not the policy's, not the frozen base), the policy's forward and its merged weights do not change when the
    critic's adapters do, the critic's values do, and the adapters are optimised in their own group and
    checkpointed with the policy. Without LoRA on the policy it is refused in one line."""
    from rl_lightning import ConfigError
    from rl_lightning.algorithms.auxiliary import run_auxiliary
    from rl_lightning.algorithms.metrics import UpdateMetrics
    from rl_lightning.models.adapters import AdapterView, LoraSettings, adapter_parameters, merged_state_dict

    torch.manual_seed(0)
    module = TEMPO(model_name_or_path="embedded:guess", critic=GenerativeCritic(weights="adapter"),
                   lora=LoraSettings(rank=4, alpha=8.0))
    module.manual_backward = lambda loss: loss.backward()  # what run_auxiliary calls, without a Trainer
    assert module.critic_model is None and isinstance(module.critic.model, AdapterView)
    critic_params = adapter_parameters(module.policy, "critic")
    assert len(critic_params) == 2 * 7 * 4  # A and B of 7 projections in each of 4 layers
    policy_group, critic_group = module.parameter_groups()
    assert critic_group["name"] == "critic"
    assert {id(p) for p in critic_group["params"]} == {id(p) for p in critic_params}
    assert not {id(p) for p in policy_group["params"]} & {id(p) for p in critic_params}  # no parameter in two groups
    assert len(module.trainable_parameters()) == len(policy_group["params"]) + len(critic_params)
    assert any(".lora_A.critic." in k for k in module.state_dict())  # checkpointed with the policy

    ids = module.tokenizer("guess 1-31:5", return_tensors="pt")["input_ids"]
    policy_logits = module.policy(input_ids=ids).logits
    merged = merged_state_dict(module.policy)
    contexts = [module.critic.context(module, ids[0].tolist())]
    rows = module.critic.ce_rows(module, contexts, torch.tensor([1.0]))
    assert rows.model is module.critic.model
    run_auxiliary(module, [(rows, torch.arange(1), 1.0)], UpdateMetrics(), 0, 0)
    assert all(p.grad is None for p in policy_group["params"])
    assert all(p.grad is None for p in module.policy.parameters() if not p.requires_grad)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in critic_params)
    before = module.critic.values(module, contexts)
    with torch.no_grad():
        for p in critic_params:
            p.add_(0.05 * torch.randn_like(p))
    assert not torch.equal(module.critic.values(module, contexts), before)  # read through its adapters
    assert torch.equal(module.policy(input_ids=ids).logits, policy_logits)  # the actor computes what it did
    after = merged_state_dict(module.policy)  # what a sampler and an export take: the policy's adapter only
    assert after.keys() == merged.keys() and all(torch.equal(after[k], merged[k]) for k in merged)
    assert all(p.requires_grad for p in critic_params)  # reading through the view leaves them trainable
    state = module.state_dict()
    assert not any(".lora_" not in k for k in state)  # a checkpoint holds adapters only, the critic's among them
    torch.manual_seed(1)  # other initial adapters: what the state restores must be the critic's trained values
    fresh = TEMPO(model_name_or_path="embedded:guess", critic=GenerativeCritic(weights="adapter"),
                  lora=LoraSettings(rank=4, alpha=8.0))
    fresh.load_state_dict(state)  # strict
    assert torch.equal(fresh.critic.values(fresh, contexts), module.critic.values(module, contexts))
    with pytest.raises(ConfigError, match=r"adapters 'critic' need LoRA on the policy \(model.init_args.lora"):
        TEMPO(model_name_or_path="embedded:guess", critic=GenerativeCritic(weights="adapter"))
