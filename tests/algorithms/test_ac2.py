"""AC2 (no public paper: docs/algorithms.md, AC2) on real 3-digit-addition chunks: advantages sum to 0 per
prefix and are shared by a chunk's tokens, the prefix is context, a finished chunk is worth R, an unfinished one a
completion's R (an audit) until its problem is ready and the critic's value after; the readiness check on numbers;
``FullRolloutAudit`` completes a fraction of the candidates and feeds the method's readiness."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl_lightning.algorithms import AC2
from rl_lightning.algorithms.ac2 import COMPLETED, CRITIC_VALUED, TARGET, VALUE
from rl_lightning.algorithms.generative_critic import BIN, GenerativeCritic, end_history
from rl_lightning.algorithms.readiness import AuditItem, CriticReadiness
from rl_lightning.callbacks import FullRolloutAudit
from rl_lightning.envs import ArithmeticTask
from rl_lightning.functional import nearest_bin
from rl_lightning.rollout import BranchRollout, RolloutDataModule, Sampling
from tests.rollout.rollout_helpers import fake_trainer


def test_readiness_needs_the_last_window_audits_below_the_threshold():
    r = CriticReadiness(threshold=0.2, window=3)
    for error in (0.1, 0.05):
        r.record(7, error)
    assert not r.ready(7)  # only 2 audits
    r.record(7, 0.19)
    assert r.ready(7) and not r.ready(8)
    r.record(7, 0.2)  # not below τ: unready until 3 good ones follow
    assert not r.ready(7)
    for _ in range(2):
        r.record(7, 0.0)
    assert not r.ready(7)
    r.record(7, 0.0)
    assert r.ready(7) and r.errors[7] == [0.0, 0.0, 0.0]
    again = CriticReadiness()
    again.load_state_dict(r.state_dict())
    assert again.ready(7) and again.errors == r.errors
    with pytest.raises(ValueError, match="threshold must be > 0"):
        CriticReadiness(threshold=0.0)


def setup() -> tuple[AC2, RolloutDataModule]:
    torch.manual_seed(0)
    module = AC2(model_name_or_path="embedded:arithmetic_hard", chunk_tokens=2, replay=4)
    dm = RolloutDataModule(task=ArithmeticTask(num_digits=3, num_heldout=8), prompts_per_step=4, group_size=4,
                           strategy=BranchRollout(n=4, max_turns=1), seed=0, sampling=Sampling(max_new_tokens=6))
    trainer = fake_trainer(module)
    trainer.datamodule, trainer.global_step = dm, 0
    dm.trainer, module._trainer = trainer, trainer
    module.check_datamodule(dm)
    return module, dm


def test_chunk_values_advantages_and_the_critic_target():
    module, dm = setup()
    batch = dm.rollout(dm.prompt_batch(0))
    assert (batch.loss_mask.sum(dim=1) <= 2).all()  # chunks of 2 tokens
    adv = module.compute_advantages(batch)
    a, v = adv.advantages.view(-1, 4), adv.rows[VALUE].view(-1, 4)
    torch.testing.assert_close(a.sum(dim=1), torch.zeros(4), atol=1e-6, rtol=0)  # Σ_i Â_i = 0 per prefix
    torch.testing.assert_close(a, v - v.mean(dim=1, keepdim=True))
    done = batch.ends.terminated
    torch.testing.assert_close(adv.rows[VALUE][done], batch.rewards[done])  # a finished chunk: R
    # nothing is ready yet: every unfinished chunk was completed, each completion an audit of the critic
    assert bool((adv.rows[COMPLETED] == (~done).float()).all()) and float(adv.rows[CRITIC_VALUED].sum()) == 0
    per_problem = (~done).view(4, 4).sum(dim=1).tolist()  # audits per problem; the last window = 3 are kept
    assert sorted(len(e) for e in module.readiness.errors.values()) == sorted(min(c, 3) for c in per_problem if c)
    assert module.critic.calls == int((~done).sum()) and module.audit_candidates() == []
    # the critic learns the rounded group mean at each prefix
    (rows,) = module.auxiliary_rows(batch, adv)
    assert rows.batch.extras[BIN].tolist() == nearest_bin(adv.rows[TARGET][::4], module.critic.levels()).tolist()
    # the unfinished chunks are stored as prefixes; replayed, they are context (no loss) and a chunk follows
    assert len(module.store) == int((~done).sum())
    module._trainer.global_step = 1
    replayed = dm.rollout(dm.prompt_batch(1))
    prefixes = {tuple(b.prefix_ids) for b in module.store.items}
    assert replayed.num_rows == 8 * 4 and (replayed.loss_mask.sum(dim=1) <= 2).all()
    assert all(len(p) == 2 for p in prefixes)
    assert all(tuple(replayed.input_ids[r, :replayed.prompt_length].tolist()[-2:]) in prefixes for r in range(16, 32))


def test_a_ready_problem_is_valued_by_the_critic_and_offered_for_audit():
    module, dm = setup()
    batch = dm.rollout(dm.prompt_batch(0))
    for key in batch.prompt_id.tolist():
        for _ in range(3):
            module.readiness.record(key, 0.0)
    adv = module.compute_advantages(batch)
    cut = batch.ends.cut.nonzero().flatten().tolist()
    expected = module.critic.values(module, [module.critic.context(module, end_history(batch, r), batch.prompts[r])
                                             for r in cut])
    torch.testing.assert_close(adv.rows[VALUE][cut], expected)
    assert float(adv.rows[COMPLETED].sum()) == 0 and float(adv.rows[CRITIC_VALUED].sum()) == len(cut)
    items = module.audit_candidates()
    assert [i.value for i in items] == pytest.approx(expected.tolist())


def test_full_rollout_audit_completes_a_fraction_and_feeds_the_readiness():
    items = [AuditItem(key=k, branch=f"b{k}", value=0.25 * k) for k in range(5)]
    recorded, metrics = [], {}
    module = SimpleNamespace(audit_candidates=lambda: items, add_step_metrics=metrics.update,
                             record_audits=lambda keys, errors: recorded.append((keys, errors)))
    rollouts = []

    def rollout_branches(branches, n, seed):
        rollouts.append((branches, n, seed))
        return SimpleNamespace(rewards=torch.ones(len(branches)))
    trainer = SimpleNamespace(global_step=3, datamodule=SimpleNamespace(rollout_branches=rollout_branches))
    FullRolloutAudit(fraction=0.5).on_train_batch_end(trainer, module, None, None, 0)
    (branches, n, _), = rollouts
    assert n == 1 and len(branches) == 3  # ceil(0.5 x 5)
    keys, errors = recorded[0]
    assert [f"b{k}" for k in keys] == branches and errors == pytest.approx([abs(0.25 * k - 1) for k in keys])
    assert float(metrics["train/audit_count"]) == 3
    assert float(metrics["train/audit_error"]) == pytest.approx(sum(errors) / 3)
    with pytest.raises(TypeError, match="does not implement audit_candidates"):
        FullRolloutAudit().on_train_batch_end(trainer, SimpleNamespace(), None, None, 0)
    with pytest.raises(ValueError, match="fraction must be in"):
        FullRolloutAudit(fraction=0.0)


@pytest.mark.parametrize("weights", ["own", "adapter"])
def test_ac2_critic_on_weights_or_adapters_of_its_own_gets_a_group_and_its_rows(weights):
    """AC2 takes the generative critic's ``weights`` as TEMPO does: the critic's own copy or adapters are attached,
    optimised in a group named ``critic`` (``component_groups``) beside the policy's, and score its rows."""
    from rl_lightning.models.adapters import LoraSettings

    torch.manual_seed(0)
    lora = LoraSettings(rank=4, alpha=8.0) if weights == "adapter" else None
    module = AC2(model_name_or_path="embedded:guess", critic=GenerativeCritic(weights=weights), lora=lora)
    groups = module.parameter_groups()
    assert [g.get("name") for g in groups] == [None, "critic"]
    critic = {id(p) for p in groups[1]["params"]}
    assert critic and not critic & {id(p) for p in groups[0]["params"]}
    trainable = [id(p) for p in module.trainable_parameters()]
    assert len(trainable) == len(set(trainable)) and critic <= set(trainable)
    contexts = [module.critic.context(module, module.tokenizer("guess 1-31:5")["input_ids"])]
    rows = module.critic.ce_rows(module, contexts, torch.tensor([1.0]))
    assert rows.model is module.critic.model and rows.model is not None
