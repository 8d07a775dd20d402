"""Critic readiness and full-rollout audits (AC2, docs/algorithms.md: the critic values a problem's chunks once
the problem is ready, and audits complete a fraction of the ready problems to check its predictions against the
outcomes).

* ``CriticReadiness`` -- the check, per problem (a key such as ``Prompt.uid``): a problem is *ready* when it has
  ``window`` audits and the absolute error ``|V̂ - R|`` of every one of its last ``window`` audits is below
  ``threshold`` (τ on ``window`` consecutive audits). One bad audit makes it unready again until ``window`` good
  ones follow. Plain values in ``state_dict`` (a ``weights_only`` checkpoint loads it).
* ``AuditItem`` and the ``AuditedCritic`` protocol -- what a method with a critic exposes so that the
  ``rl_lightning.callbacks.FullRolloutAudit`` callback can audit it: ``audit_candidates()``, the predictions of this
  step that a completed rollout can check (a key, the ``Branch`` to complete, the value predicted there), and
  ``record_audits(keys, errors)``, which feeds its readiness check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class CriticReadiness:
    """Per-problem readiness from audit errors (see the module docstring).

    Args:
        threshold: ``τ``: an audit passes when ``|V̂ - R| < τ``.
        window: ``k``: the last ``k`` audits must all pass (and there must be ``k``).
    """

    def __init__(self, threshold: float = 0.2, window: int = 3) -> None:
        if threshold <= 0 or window < 1:
            raise ValueError(f"CriticReadiness: threshold must be > 0 and window >= 1, got {threshold}, {window}")
        self.threshold, self.window = float(threshold), int(window)
        self.errors: dict[int, list[float]] = {}

    def record(self, key: int, error: float) -> None:
        """Add one audit of problem ``key`` (its absolute error); only the last ``window`` are kept."""
        self.errors[int(key)] = (self.errors.get(int(key), []) + [float(error)])[-self.window:]

    def ready(self, key: int) -> bool:
        last = self.errors.get(int(key), [])
        return len(last) == self.window and max(last) < self.threshold

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "window": self.window,
                "errors": {str(k): list(v) for k, v in self.errors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.threshold, self.window = float(state["threshold"]), int(state["window"])
        self.errors = {int(k): list(v) for k, v in state["errors"].items()}


@dataclass(frozen=True)
class AuditItem:
    """One prediction a full rollout can check: problem ``key``, the ``branch`` (``rollout.Branch``) whose completion
    gives the outcome, and the ``value`` the critic predicted for it."""

    key: int
    branch: Any
    value: float


@runtime_checkable
class AuditedCritic(Protocol):
    """What a method implements for ``FullRolloutAudit``: the step's checkable predictions, and where the audits'
    errors go (its readiness check). Both are called once per step, after the update, on every rank."""

    def audit_candidates(self) -> list[AuditItem]: ...

    def record_audits(self, keys: list[int], errors: list[float]) -> None: ...
