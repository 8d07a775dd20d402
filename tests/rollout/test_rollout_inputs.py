"""``RolloutInputs``: a method declares what its rollouts need (``RLModule.rollout_inputs``); the data module reads
the declaration once when it binds the module, hands each input to the piece that uses it and refuses a
configuration that cannot serve it, naming the field."""

from __future__ import annotations

import pytest
import torch

from rl_lightning import ConfigError
from rl_lightning.algorithms import GRPO, SPO
from rl_lightning.envs import GuessNumberTask
from rl_lightning.rollout import BranchRollout, RolloutDataModule, RolloutInputs, Sampling, WeightedSampler
from tests.conftest import tiny_datamodule, tiny_trainer


def test_each_input_goes_to_the_piece_that_uses_it():
    branches, weights = (lambda step, prompts: []), (lambda prompts: [1.0] * len(prompts))
    data = RolloutDataModule(task=GuessNumberTask(), prompts_per_step=2, group_size=4,
                             strategy=BranchRollout(n=4, max_turns=5), prompt_sampler=WeightedSampler(pool_size=8),
                             sampling=Sampling(max_new_tokens=3))
    data.take_inputs(RolloutInputs(branches=branches, prompt_weights=weights), "Mine")
    assert data.strategy._fn is branches and data.prompt_sampler.weight_fn is weights
    data.take_inputs(RolloutInputs())  # nothing declared: nothing changes
    assert data.strategy._fn is branches and data.prompt_sampler.weight_fn is weights


def test_a_configuration_that_cannot_serve_a_declared_input_is_refused_naming_the_field():
    plain = tiny_datamodule()  # GroupRollout, SequentialSampler
    with pytest.raises(ConfigError, match=r"Mine sets where its rollouts start .* data\.init_args\.strategy must be a "
                                          r"rl_lightning\.rollout\.BranchRollout, got GroupRollout"):
        plain.take_inputs(RolloutInputs(branches=lambda step, prompts: []), "Mine")
    with pytest.raises(ConfigError, match=r"Mine weights the prompts it draws .* data\.init_args\.prompt_sampler must "
                                          r"be a rl_lightning\.rollout\.WeightedSampler, got SequentialSampler"):
        plain.take_inputs(RolloutInputs(prompt_weights=lambda prompts: [1.0] * len(prompts)), "Mine")


def test_the_data_module_serves_the_trained_modules_declaration_when_it_binds_it(tmp_path):
    """SPO declares its tracker's weights; after ``setup`` the sampler draws by them. A plain GRPO declares nothing
    and leaves a ``WeightedSampler`` uniform."""
    optimizer = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    spo = SPO(model_name_or_path="embedded:arithmetic", optimizer=optimizer)
    data = tiny_datamodule(group_size=1, prompt_sampler=WeightedSampler(pool_size=6))
    tiny_trainer(tmp_path, max_steps=1).fit(spo, datamodule=data)
    assert data.prompt_sampler.weight_fn == spo.prompt_weights
    grpo = GRPO(model_name_or_path="embedded:arithmetic", optimizer=optimizer)
    data = tiny_datamodule(prompt_sampler=WeightedSampler(pool_size=6))
    tiny_trainer(tmp_path, max_steps=1).fit(grpo, datamodule=data)
    assert data.prompt_sampler.weight_fn is None
