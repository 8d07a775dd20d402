"""Traps of extending from outside (the 2026-methods issue): a hook's output of the wrong shape is refused where it
enters the base, naming the hook and the shape expected; a method name one edit from a hook warns at class creation."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from rl_lightning.algorithms import GRPO, RLModule
from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_hook_output
from tests.conftest import tiny_datamodule, tiny_trainer


class SequenceObjective(GRPO):
    """A sequence-level objective returned as [n] instead of [n, T] (the mistake a GSPO-style method makes)."""

    def policy_objective(self, batch, out, ratio, adv):
        return (ratio * adv.advantages).mean(dim=1), {}


class FlatAdvantages(GRPO):
    def compute_advantages(self, batch):
        return torch.zeros(batch.num_rows + 1)


@pytest.mark.parametrize("cls, hook, shape", [
    (SequenceObjective, "policy_objective", "[n, T]"), (FlatAdvantages, "compute_advantages", "[N] one per response"),
])
def test_a_hook_output_of_the_wrong_shape_is_refused_naming_the_hook(tmp_path, cls, hook, shape):
    module = cls(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    # 4 rows of at most 4 tokens: an [n] objective would broadcast against [n, T] without a word
    with pytest.raises(ValueError,
                       match=rf"^{cls.__name__}\.{hook} returned a tensor of shape .*{re.escape(shape)}") as err:
        tiny_trainer(tmp_path, max_steps=1).fit(module, datamodule=tiny_datamodule(prompts_per_step=1, group_size=4))
    assert "\n" not in str(err.value)


def test_check_hook_output_on_numbers():
    owner = GRPO.__new__(GRPO)
    check_hook_output(owner, "h", torch.zeros(3, 4), [(3, 4)], "x")  # accepted
    with pytest.raises(ValueError, match=r"GRPO\.h returned a tensor of shape \[4, 4\]; expected \[3, 4\] or \[3\]"):
        check_hook_output(owner, "h", torch.zeros(4, 4), [(3, 4), (3,)], "x")
    with pytest.raises(ValueError, match=r"returned a tuple; expected \[3\]"):
        check_hook_output(owner, "h", (1, 2, 3), [(3,)], "x")


def test_a_misspelt_hook_warns_when_the_class_is_made():
    with pytest.warns(UserWarning, match=r"Typo\.policy_objectve is not a hook of GRPO; did you mean policy_objective"):
        class Typo(GRPO):
            def policy_objectve(self, batch, out, ratio, adv):
                return ratio, {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a helper of its own, a real hook, a private name: no warning

        class Fine(GRPO):
            def forecast_weights(self):
                return None

            def policy_objective(self, batch, out, ratio, adv):
                return super().policy_objective(batch, out, ratio, adv)

            def _compute_advantage(self):
                return None

        class Direct(RLModule):
            def compute_advantages(self, batch):
                return Advantages(batch.rewards)


def test_a_subclass_can_take_over_a_parents_setting_check():
    """GRPO refuses clip_eps_low >= 1; a subclass that means "no floor" by it relaxes GRPO's rule and checks its
    own (relaxed_settings + check_settings(own=True)); GRPO itself still refuses."""
    from rl_lightning import ConfigError, check_settings
    from rl_lightning.algorithms import GRPO

    class NoFloorGRPO(GRPO):
        relaxed_settings = frozenset({"clip_eps_low"})

        def __init__(self, **kwargs) -> None:  # noqa: ANN003
            super().__init__(**kwargs)
            check_settings(self, [("clip_eps_low", self.clip_eps_low, self.clip_eps_low >= 0, "must be >= 0")],
                           own=True)

    assert NoFloorGRPO(model_name_or_path="embedded:random", clip_eps_low=5.0).clip_eps_low == 5.0
    with pytest.raises(ConfigError, match=r"GRPO: clip_eps_low must be in \[0, 1\), got 5.0"):
        GRPO(model_name_or_path="embedded:random", clip_eps_low=5.0)
    with pytest.raises(ConfigError, match="NoFloorGRPO: clip_eps_low must be >= 0, got -1.0"):
        NoFloorGRPO(model_name_or_path="embedded:random", clip_eps_low=-1.0)
    with pytest.raises(ConfigError, match="NoFloorGRPO: clip_eps_high must be >= 0"):  # other rules still hold
        NoFloorGRPO(model_name_or_path="embedded:random", clip_eps_high=-1.0)
