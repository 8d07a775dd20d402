"""Adapters for task suites from the ecosystem, as optional extras (see docs/environments.md).

* ``GemEnv`` / ``GemTask``: gem-llm's multi-turn games (``pip install 'rl-lightning[gem]'`` then
  ``pip install --no-deps gem-llm==0.1.0``).
* ``ReasoningGymTask`` / ``ReasoningGymReward``: reasoning-gym's single-turn datasets, scored by answer
  extraction + exact match (``pip install 'rl-lightning[reasoning-gym]'``).

Importing this package needs neither library: they are imported when an adapter is built, and a missing one
raises a one-line ``ImportError`` naming what to install.
"""

from rl_lightning.envs.adapters.gem_envs import GemEnv, GemTask
from rl_lightning.envs.adapters.reasoning_gym_tasks import ReasoningGymReward, ReasoningGymTask, normalize_answer

__all__ = ["GemEnv", "GemTask", "ReasoningGymReward", "ReasoningGymTask", "normalize_answer"]
