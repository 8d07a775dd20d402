"""``Advantages``: what ``RLModule.compute_advantages`` returns, fixed once per rollout batch and read by the losses.

The batch itself is never written to: a method that computes more than advantages at the start of the update
(a critic's values and returns, per-row weights of a loss term, a per-row ``λ``) returns it here, and ``update``
slices it with the rows of every minibatch and micro-batch (``select``) and cuts its per-token fields with the
micro-batch's columns (``cut``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import Tensor

from rl_lightning.algorithms.checks import check_hook_output


@dataclass(frozen=True)
class Advantages:
    """The per-rollout-batch quantities the update's losses read.

    Attributes:
        advantages: ``[N, 1]`` (one per response, broadcast over its tokens) or ``[N, T]`` (per token), detached.
        values: ``[N, T]`` the critic's values at rollout time (``V_old``), for methods with a critic.
        returns: ``[N, T]`` the critic's targets.
        rows: per-row ``[N]`` tensors a method adds, by name (EasyPPO's value-loss weights, CoPE's forecasting
            weights, the per-response ``λ`` of length-adaptive GAE).
    """

    advantages: Tensor
    values: Tensor | None = None
    returns: Tensor | None = None
    rows: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.advantages.shape[0]
        for name, value in {"values": self.values, "returns": self.returns, **self.rows}.items():
            if value is not None and value.shape[0] != n:
                raise ValueError(f"Advantages.{name} has {value.shape[0]} rows, the advantages {n}")

    @property
    def num_rows(self) -> int:
        return self.advantages.shape[0]

    def select(self, index: Tensor) -> Advantages:
        """The rows ``index`` of every field."""
        pick = (lambda t: None if t is None else t[index])  # noqa: E731
        return Advantages(self.advantages[index], pick(self.values), pick(self.returns),
                          {k: v[index] for k, v in self.rows.items()})

    def cut(self, width: int) -> Advantages:
        """The per-token fields cut to their first ``width`` columns (a micro-batch trimmed of padding)."""
        adv = self.advantages if self.advantages.shape[1] == 1 else self.advantages[:, :width]
        cut = (lambda t: None if t is None else t[:, :width])  # noqa: E731
        return replace(self, advantages=adv, values=cut(self.values), returns=cut(self.returns))


def checked_advantages(owner: Any, value: Tensor | Advantages, shape: tuple[int, ...]) -> Advantages:
    """``owner.compute_advantages``' output as a detached ``Advantages`` whose advantages are ``[N, 1]`` or
    ``[N, T]`` (``shape``: the rollout batch's ``[N, T]``); any other shape is refused in one line naming the hook
    (``checks.check_hook_output``)."""
    adv = value if isinstance(value, Advantages) else Advantages(value)
    n, t = shape
    check_hook_output(owner, "compute_advantages", adv.advantages, [(n,), (n, 1), (n, t)],
                      "[N] one per response or [N, T] one per token of the rollout batch")
    return replace(adv, advantages=adv.advantages.detach().reshape(n, -1))
