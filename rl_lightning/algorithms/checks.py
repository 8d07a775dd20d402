"""``check_settings``: the one way a method refuses an invalid constructor argument.

Each rule is ``(field, value, valid, rule)``; the first invalid one raises ``ValueError("<Class>: <field> <rule>,
got <value>")``, which the CLI reports with the config file and line of the field (``model.init_args.<field>``).
"""

from __future__ import annotations

from typing import Any, Iterable


def check_settings(owner: Any, rules: Iterable[tuple[str, Any, bool, str]]) -> None:
    """Raise for the first rule whose ``valid`` is false (see the module docstring)."""
    for name, value, valid, rule in rules:
        if not valid:
            raise ValueError(f"{type(owner).__name__}: {name} {rule}, got {value!r}")
