"""Keeping an optional library's global side effects out of the caller's process state.

Both suites touch process-wide state: gem's ``Env.reset(seed)`` calls ``random.seed`` and ``np.random.seed``
(and its games draw from the global ``random`` module), importing reasoning-gym advances the global
``random`` stream, and ``import gem`` calls ``logging.basicConfig(level=INFO)`` on the root logger. The helpers
here save that state and put it back.

None of this is thread-safe: the global RNGs are swapped in and out, so two threads running gem calls at once
would interleave their draws (the rollout loop steps environments from one thread).
"""

from __future__ import annotations

import importlib
import logging
import random
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Iterator

import numpy as np


def global_rng_state() -> tuple[Any, Any]:
    """The global ``random`` and NumPy (legacy ``np.random``) states."""
    return random.getstate(), np.random.get_state()


def set_global_rng_state(state: tuple[Any, Any]) -> None:
    random.setstate(state[0])
    np.random.set_state(state[1])


def seeded_rng_state(seed: int) -> tuple[Any, Any]:
    """A ``(random, numpy)`` state pair as ``random.seed(seed); np.random.seed(seed)`` would leave it, built
    without touching the global generators."""
    return random.Random(seed).getstate(), np.random.RandomState(seed).get_state()


@contextmanager
def preserved_global_rngs() -> Iterator[None]:
    """Run the block, then put the global ``random`` and NumPy states back as they were before it."""
    saved = global_rng_state()
    try:
        yield
    finally:
        set_global_rng_state(saved)


@contextmanager
def private_global_rngs(owner: Any, attribute: str) -> Iterator[None]:
    """Run the block with the global ``random``/NumPy generators set to ``owner.<attribute>`` (a state pair),
    store what the block left in them back into ``owner.<attribute>``, and restore the caller's states.

    A library that draws from (and reseeds) the global generators then sees its own continuing stream, and the
    caller's streams are exactly as they were.
    """
    outer = global_rng_state()
    set_global_rng_state(getattr(owner, attribute))
    try:
        yield
    finally:
        setattr(owner, attribute, global_rng_state())
        set_global_rng_state(outer)


def import_optional(module: str, what: str, install: str) -> ModuleType:
    """Import ``module`` without its import-time side effects on the global RNGs and the root logger.

    Raises:
        ImportError: one line naming ``what`` needs it and the ``install`` command (with the original error).
    """
    if sys.modules.get(module) is not None:  # already imported (``None`` there blocks the import)
        return sys.modules[module]
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with preserved_global_rngs():
            return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{what} needs the optional package {module!r} ({err}); install it with: {install}") from err
    finally:
        for handler in root.handlers[:]:  # undo a logging.basicConfig the import ran
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
