"""``data_kwargs``: a ``RolloutDataModule``'s keyword arguments from its arguments and its settings groups' fields."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from rl_lightning.rollout.settings import GROUPS


def data_kwargs(**kwargs: Any) -> dict[str, Any]:
    """``kwargs`` with every field of a settings group (``temperature=1.5``, ``queue=2``) moved into its group: the
    group given in ``kwargs`` (``sampling=Sampling(max_new_tokens=4)``) or the group's defaults. The groups' field
    names are distinct from each other and from the data module's own arguments, so a field names its group."""
    for name, cls in GROUPS.items():
        mine = {f.name for f in fields(cls)} & set(kwargs)
        if mine:
            kwargs[name] = replace(kwargs.get(name, cls()), **{f: kwargs.pop(f) for f in mine})
    return kwargs
