"""``check_settings``: the one way a method refuses an invalid constructor argument; ``check_finite``: the one way an
update refuses a non-finite loss or gradient (``NonFiniteLossError``, before any optimiser step).

Each rule is ``(field, value, valid, rule)``; the first invalid one raises ``ValueError("<Class>: <field> <rule>,
got <value>")``, which the CLI reports with the config file and line of the field (``model.init_args.<field>``).
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import Tensor


class NonFiniteLossError(FloatingPointError):
    """A loss or gradient was NaN/inf; raised before the optimiser step, so the weights stay finite."""


def check_settings(owner: Any, rules: Iterable[tuple[str, Any, bool, str]]) -> None:
    """Raise for the first rule whose ``valid`` is false (see the module docstring)."""
    for name, value, valid, rule in rules:
        if not valid:
            raise ValueError(f"{type(owner).__name__}: {name} {rule}, got {value!r}")


def check_finite(value: Tensor, what: str, step: int, iteration: int, minibatch: int) -> None:
    """Raise ``NonFiniteLossError`` naming the step, iteration and minibatch if ``value`` is not finite."""
    if not value.isfinite().all():
        raise NonFiniteLossError(
            f"non-finite {what} ({value.item() if value.numel() == 1 else value}) at step {step} "
            f"(iteration {iteration}, minibatch {minibatch}); the weights were not updated")
