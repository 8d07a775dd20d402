"""``ConfigError``: the one exception type for "this setting is wrong", in the library and in user code alike.

It lives in the lowest layer so that every layer (tasks and rewards, rollout strategies, methods, callbacks) and
any out-of-tree class can raise it. The command line reports a ``ConfigError`` raised anywhere -- a constructor,
``check_datamodule``, a strategy, a reward function -- as one line with exit status 2 (naming the config file and
line of the field where it can), never as a traceback. ``rl_lightning.algorithms.check_settings`` raises it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration the run cannot use; its message names the field, the rule and the value it got."""
