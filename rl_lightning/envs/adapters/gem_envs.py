"""gem-llm's multi-turn text games as rl_lightning environments and tasks (optional: ``gem-llm==0.1.0``).

``GemEnv("game:GuessTheNumber-v0-easy", seed=7)`` wraps one gem environment (``gem.make(env_id)``) in the
``Environment`` API; ``GemTask`` is a training stream of game seeds, a fixed held-out set of seeds, and
``make_env`` building the ``GemEnv`` of a prompt's seed. Tested offline with the games GuessTheNumber,
Mastermind and TowerofHanoi (ids ``game:<Game>-v0-easy|hard|random``); gem's word games (Wordle, Hangman,
WordSearch) download NLTK corpora at run time and are not supported.

What the wrapper does on top of gem:

* **Global RNGs.** gem's ``reset(seed)`` calls ``random.seed``/``np.random.seed`` and its games draw from the
  global ``random`` module (also when constructed: ``gem.make`` runs an unseeded ``reset``). Every gem call runs
  with the global ``random``/NumPy states swapped for the wrapper's own (``_rng_state``), which is put back
  afterwards, so the caller's streams are untouched and an episode depends only on its seed.
* **Observations.** gem returns only the newest message and keeps hints in ``info["suffix"]`` (TowerofHanoi's
  board is only there). As gem's own ``ObservationWrapper`` does, the observation is
  ``info["prefix"] + message + "\\n" + info["suffix"]`` (``add_prefix_suffix``); the conversation so far is
  already in the model's context. The suffix is left off the last observation of an episode.
* **Rewards, ends.** Rewards, ``terminated`` and ``truncated`` are gem's. gem ends an episode on an action it
  cannot parse (no ``\\boxed{...}``: reward -0.1, terminated), and at its own turn limit returns
  ``terminated=True`` *and* ``truncated=True`` (with a partial reward, e.g. GuessTheNumber's distance score).
  Run ``GroupRollout(max_turns >= the game's max_turns)`` so the game, not the rollout, ends the episode.
* **Snapshots.** The inherited ``snapshot``/``restore`` deep-copy the wrapper, i.e. the gem environment and the
  private RNG state (gem's game environments deep-copy and pickle; tested for the three games above).
"""

from __future__ import annotations

import random
from typing import Any

from rl_lightning.envs.adapters._isolation import import_optional, private_global_rngs, seeded_rng_state
from rl_lightning.envs.base import Prompt, RewardFunction, Task
from rl_lightning.envs.environment import Environment, StepResult

GEM_INSTALL = "pip install 'rl-lightning[gem]' && pip install --no-deps gem-llm==0.1.0 (see docs/environments.md)"
#: seeds gem accepts (``np.random.seed`` takes 0 <= seed < 2**32); game seeds are drawn below 2**31
MAX_SEED = 2**32


def import_gem() -> Any:
    """The ``gem`` module, imported without its side effects (see ``_isolation.import_optional``)."""
    return import_optional("gem", "GemEnv/GemTask", GEM_INSTALL)


def _check_seed(where: str, seed: int | None) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED):
        raise ValueError(f"{where}: a gem seed must be an int in [0, 2**32), got {seed!r}")


class GemEnv(Environment):
    """One gem environment in the ``Environment`` API (see the module docstring).

    Args:
        env_id: a gem registry id, e.g. ``"game:GuessTheNumber-v0-easy"``, ``"game:Mastermind-v0-easy"``,
            ``"game:TowerofHanoi-v0-easy"``.
        seed: the game's seed: every ``reset`` starts this game, whatever seed ``reset`` is given (so the
            ``G`` episodes of a group play the same game). ``None``: ``reset(seed)`` picks it; ``reset()``
            without a seed continues the wrapper's private RNG stream.
        env_kwargs: keyword arguments for ``gem.make`` (override the registered ones, e.g. ``max_turns``).
        add_prefix_suffix: wrap each observation in gem's ``info["prefix"]``/``info["suffix"]``.
    """

    def __init__(self, env_id: str, seed: int | None = None, env_kwargs: dict[str, Any] | None = None,
                 add_prefix_suffix: bool = True) -> None:
        gem = import_gem()
        _check_seed("GemEnv", seed)
        from gem.envs.registration import ENV_REGISTRY

        if env_id not in ENV_REGISTRY:
            games = ", ".join(sorted(k for k in ENV_REGISTRY if k.startswith("game:")))
            raise ValueError(f"GemEnv: no gem environment {env_id!r} (game ids: {games})")
        self.env_id, self.seed, self.add_prefix_suffix = env_id, seed, add_prefix_suffix
        self.env_kwargs = dict(env_kwargs or {})
        self._rng_state = seeded_rng_state(0 if seed is None else seed)
        with private_global_rngs(self, "_rng_state"):
            self.env = gem.make(env_id, **self.env_kwargs)
        self.over = True  # until reset

    def _text(self, observation: Any, info: dict[str, Any], last: bool) -> str:
        text = str(observation)
        if not self.add_prefix_suffix:
            return text
        if not last and info.get("suffix"):
            text = (text if not text or text.endswith("\n") else text + "\n") + str(info["suffix"])
        if info.get("prefix"):
            text = str(info["prefix"]) + text
        return text

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        game_seed = self.seed if self.seed is not None else seed
        _check_seed("GemEnv.reset", game_seed)
        with private_global_rngs(self, "_rng_state"):
            observation, info = self.env.reset(seed=game_seed)
        self.over = False
        info = dict(info or {})
        return self._text(observation, info, last=False), info

    def step(self, action: str) -> StepResult:
        if self.over:
            raise RuntimeError(f"GemEnv({self.env_id!r}): step after the episode ended; call reset first")
        with private_global_rngs(self, "_rng_state"):
            observation, reward, terminated, truncated, info = self.env.step(action)
        terminated, truncated = bool(terminated), bool(truncated)
        self.over = terminated or truncated
        info = dict(info or {})
        return self._text(observation, info, last=self.over), float(reward), terminated, truncated, info


class GemTask(Task):
    """Episodes of one gem game: the training stream draws game seeds, the held-out set is ``num_heldout``
    fixed seeds never drawn for training, and each prompt's environment is the ``GemEnv`` of its seed.

    A prompt's text is the game's first observation (what the model reads first), its metadata the game seed
    (``metadata["seed"]``, also its ``uid``); it has no reference answer (the game scores the episode). Seeds
    are disjoint, games need not be: a small game (GuessTheNumber-easy has 10 secrets) repeats the held-out
    games in training under other seeds, so its ``val/reward`` measures play, not unseen games.

    Args:
        env_id: the gem registry id (see ``GemEnv``).
        env_kwargs: keyword arguments for ``gem.make``.
        num_heldout: size of the held-out seed set (greedy return over it is ``val/reward``).
        seed: seeds both the held-out set and the training stream.
        add_prefix_suffix: see ``GemEnv``.
    """

    def __init__(self, env_id: str = "game:GuessTheNumber-v0-easy", env_kwargs: dict[str, Any] | None = None,
                 num_heldout: int = 64, seed: int = 1234, add_prefix_suffix: bool = True) -> None:
        if num_heldout < 0:
            raise ValueError(f"GemTask: num_heldout must be >= 0, got {num_heldout}")
        self.env_id, self.seed, self.num_heldout, self.add_prefix_suffix = env_id, seed, num_heldout, add_prefix_suffix
        self.env_kwargs = dict(env_kwargs or {})
        GemEnv(env_id, 0, self.env_kwargs, add_prefix_suffix)  # fail now on a missing package or an unknown id
        rng = random.Random(seed)
        seeds: dict[int, None] = {}  # draw order
        while len(seeds) < num_heldout:
            seeds[rng.randrange(2**31)] = None
        self.heldout_seeds: list[int] = list(seeds)
        self._heldout_set = set(seeds)
        self._heldout: list[Prompt] | None = None

    def train_seed(self, index: int) -> int:
        """The game seed at position ``index`` of the training stream (never a held-out seed)."""
        rng = random.Random(self.seed * 1_000_003 + 7919 * index + 1)
        while True:
            seed = rng.randrange(2**31)
            if seed not in self._heldout_set:
                return seed

    def make_prompt(self, seed: int) -> Prompt:
        text, _ = self._env(seed).reset()
        return Prompt(text=text, answer=None, metadata={"seed": seed, "uid": seed, "env_id": self.env_id})

    def train_prompt(self, index: int) -> Prompt:
        return self.make_prompt(self.train_seed(index))

    def heldout_prompts(self) -> list[Prompt]:
        if self._heldout is None:
            self._heldout = [self.make_prompt(seed) for seed in self.heldout_seeds]
        return list(self._heldout)

    def _env(self, seed: int) -> GemEnv:
        return GemEnv(self.env_id, seed, self.env_kwargs, self.add_prefix_suffix)

    def make_env(self, prompt: Prompt, reward_fn: RewardFunction) -> GemEnv:
        """The prompt's game; ``reward_fn`` is not used (gem scores the episode)."""
        return self._env(int(prompt.metadata["seed"]))
