"""``RolloutInputs``: what a trained module's rollouts need from it, declared by the module and read once by the
data module.

A method that steers its own rollouts declares it in ``RLModule.rollout_inputs()`` (TEMPO and AC2 say where each
step's rollouts start, SPO by what weights prompts are drawn); the ``RolloutDataModule`` reads the declaration when
it binds the module (``take_inputs``), checks that its configuration can serve it, and hands each input to the
piece that uses it. The module never calls into the data module, and the data module reads nothing else of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rl_lightning.rollout.branching import BranchFn
from rl_lightning.rollout.prompts import WeightFn


@dataclass(frozen=True)
class RolloutInputs:
    """A module's declared rollout inputs (each ``None``: not used).

    Attributes:
        branches: ``fn(step, prompts) -> list[Branch]``, where each training step's rollouts start (saved states
            or prefixes; ``prompts`` is the step's ``PromptBatch``). Needs ``data.init_args.strategy`` to be a
            ``BranchRollout``, which calls ``fn`` (``BranchRollout.branches_from``).
        prompt_weights: ``fn(prompts) -> weights``, one weight per prompt of the pool, read at every draw. Needs
            ``data.init_args.prompt_sampler`` to be a ``WeightedSampler`` (``WeightedSampler.weights_from``).
    """

    branches: BranchFn | None = None
    prompt_weights: WeightFn | None = None


@runtime_checkable
class DeclaresRolloutInputs(Protocol):
    """A module with ``rollout_inputs()`` (every ``RLModule``)."""

    def rollout_inputs(self) -> RolloutInputs: ...
