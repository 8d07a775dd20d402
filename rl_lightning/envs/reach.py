"""Reach the target: a multi-turn task with distinct starting states and long horizons (8-10 model turns).

An episode: the first observation shows a start and a target number, ``"s17 t52:"``. Each turn the model plays
one move of ``+1 +5 -3 *2`` (two characters); the environment answers with the new value, ``"22:"`` (at most 3
characters, so a turn and its answer take at most 3 + 3 tokens of the character tokenizer and a whole episode fits
``GroupRollout``'s default budget of ``max_turns x max_new_tokens x 2``). Reaching the
target ends the episode with reward 1; an invalid move (anything else, or one that leaves ``0..99``) ends it with
reward 0, and so does the turn limit (``max_moves``, 10) without reaching it. An episode as the model sees it::

    <bos>s17 t52:+5<eos>22:*2<eos>44:+5<eos>49:+1<eos>50:+1<eos>51:+1<eos>

Every state is in the context: the start and target in the prompt, the current value in the last observation,
the turns used by counting them, so a state's value is readable from the history (what a critic needs).

``ReachTargetTask`` draws its start/target pairs from a fixed pool: every pair of ``0..99`` whose target is
``min_gap..max_gap`` above the start (30..70) and whose shortest solution takes ``min_moves..max_moves_optimal``
moves (4..8). The pool is shuffled once by ``seed``; its first ``num_heldout`` pairs are the test split
(``heldout_prompts``), the next ``num_validation`` the validation split (``validation_prompts``), and the training
stream draws uniformly from the rest. Without ``*2`` most targets are out of reach in 10 moves (``+5`` covers at most
50): the doubling move, played at the right value, is what solves the far ones.
"""

from __future__ import annotations

import random
from collections import deque
from functools import lru_cache
from typing import Any

from rl_lightning.envs.base import Prompt, RewardFunction, Task
from rl_lightning.envs.environment import Environment, StepResult

#: the moves a turn may play, in the order the planners break ties
MOVES: tuple[str, ...] = ("+1", "+5", "-3", "*2")
#: values are integers of ``0..MAX_VALUE``; a move that leaves the range is invalid
MAX_VALUE = 99


def apply_move(value: int, move: str, max_value: int = MAX_VALUE) -> int | None:
    """The value after ``move`` (one of ``MOVES``), or ``None`` when the move is unknown or leaves ``0..max_value``."""
    if move == "+1":
        new = value + 1
    elif move == "+5":
        new = value + 5
    elif move == "-3":
        new = value - 3
    elif move == "*2":
        new = value * 2
    else:
        return None
    return new if 0 <= new <= max_value else None


@lru_cache(maxsize=None)
def distances_to(target: int, moves: tuple[str, ...] = MOVES, max_value: int = MAX_VALUE) -> tuple[int | None, ...]:
    """``d[v]``: the fewest ``moves`` from ``v`` to ``target`` (``None``: unreachable), by breadth-first search."""
    preds: list[list[int]] = [[] for _ in range(max_value + 1)]
    for v in range(max_value + 1):
        for m in moves:
            w = apply_move(v, m, max_value)
            if w is not None:
                preds[w].append(v)
    dist: list[int | None] = [None] * (max_value + 1)
    dist[target] = 0
    queue = deque([target])
    while queue:
        w = queue.popleft()
        for v in preds[w]:
            if dist[v] is None:
                dist[v] = dist[w] + 1
                queue.append(v)
    return tuple(dist)


def best_move(value: int, target: int, moves: tuple[str, ...] = MOVES, max_value: int = MAX_VALUE) -> str | None:
    """A first move of a shortest solution from ``value`` with ``moves`` (ties: the first in ``moves``); ``None``
    when ``value`` is the target or the target is unreachable."""
    dist = distances_to(target, moves, max_value)
    best: tuple[int, str] | None = None
    for m in moves:
        w = apply_move(value, m, max_value)
        if w is not None and dist[w] is not None and (best is None or dist[w] < best[0]):
            best = (dist[w], m)
    return None if value == target or best is None else best[1]


def shortest_solution(start: int, target: int, moves: tuple[str, ...] = MOVES,
                      max_value: int = MAX_VALUE) -> list[str] | None:
    """A shortest list of ``moves`` from ``start`` to ``target`` (``[]`` when equal, ``None`` when unreachable)."""
    if distances_to(target, moves, max_value)[start] is None:
        return None
    out, value = [], start
    while value != target:
        move = best_move(value, target, moves, max_value)
        out.append(move)
        value = apply_move(value, move, max_value)
    return out


class ReachTargetEnv(Environment):
    """One episode of reach-the-target (see the module docstring).

    Args:
        start, target: the numbers the prompt shows (in ``0..max_value``, different).
        max_moves: model turns allowed; the episode ends (terminated, reward 0) after the last one misses.
        max_value: values stay in ``0..max_value``; a move that leaves it is invalid.
    """

    def __init__(self, start: int, target: int, max_moves: int = 10, max_value: int = MAX_VALUE) -> None:
        if not (0 <= start <= max_value and 0 <= target <= max_value) or start == target:
            raise ValueError(f"ReachTargetEnv: need different start and target in 0..{max_value}, "
                             f"got {start}, {target}")
        if max_moves < 1:
            raise ValueError(f"ReachTargetEnv: max_moves must be >= 1, got {max_moves}")
        self.start, self.target, self.max_moves, self.max_value = start, target, max_moves, max_value
        self.value = start
        self.moves: list[str] = []
        self.done = False

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.value, self.moves, self.done = self.start, [], False
        return f"s{self.start} t{self.target}:", {"start": self.start, "target": self.target}

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("ReachTargetEnv: step() after the episode ended (reset() starts a new one)")
        move = action.strip()
        self.moves.append(move)
        new = apply_move(self.value, move, self.max_value)
        if new is None:
            self.done = True
            return "", 0.0, True, False, {"reached": False, "invalid": True}
        self.value = new
        if new == self.target:
            self.done = True
            return "", 1.0, True, False, {"reached": True}
        if len(self.moves) >= self.max_moves:
            self.done = True
            return "", 0.0, True, False, {"reached": False}
        return f"{new}:", 0.0, False, False, {}


class ReachTargetTask(Task):
    """Reach-the-target episodes (``ReachTargetEnv``) from distinct start/target pairs, with a test split and a
    validation split that the training stream never draws (see the module docstring).

    Args:
        num_heldout: pairs of the test split (``heldout_prompts``).
        num_validation: pairs of the validation split (``validation_prompts``).
        max_moves: model turns per episode (run it with ``GroupRollout(max_turns >= max_moves)``).
        min_gap, max_gap: how far above the start the target lies.
        min_optimal, max_optimal: the range of the shortest solution's length.
        seed: shuffles the pool (the splits) and seeds the training stream.
    """

    def __init__(self, num_heldout: int = 400, num_validation: int = 200, max_moves: int = 10, min_gap: int = 30,
                 max_gap: int = 70, min_optimal: int = 4, max_optimal: int = 8, seed: int = 1234) -> None:
        if max_moves < 1:
            raise ValueError(f"ReachTargetTask: max_moves must be >= 1, got {max_moves}")
        if num_heldout < 0 or num_validation < 0:
            raise ValueError(f"ReachTargetTask: num_heldout and num_validation must be >= 0, got {num_heldout}, "
                             f"{num_validation}")
        pool = [(s, t) for s in range(MAX_VALUE + 1) for t in range(MAX_VALUE + 1)
                if min_gap <= t - s <= max_gap and s != t
                and min_optimal <= (distances_to(t)[s] if distances_to(t)[s] is not None else -1) <= max_optimal]
        if num_heldout + num_validation >= len(pool):
            raise ValueError(f"ReachTargetTask: num_heldout + num_validation = {num_heldout + num_validation} leaves "
                             f"no training pairs of the {len(pool)} in the pool")
        random.Random(seed).shuffle(pool)
        self.test = pool[:num_heldout]
        self.validation = pool[num_heldout:num_heldout + num_validation]
        self.train = pool[num_heldout + num_validation:]
        self.max_moves, self.seed = max_moves, seed
        self.min_gap, self.max_gap, self.min_optimal, self.max_optimal = min_gap, max_gap, min_optimal, max_optimal

    @staticmethod
    def make_prompt(start: int, target: int) -> Prompt:
        return Prompt(text=f"s{start} t{target}:", answer=str(target),
                      metadata={"start": start, "target": target, "uid": start * (MAX_VALUE + 1) + target})

    def train_prompt(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + 7919 * index + 1)
        return self.make_prompt(*self.train[rng.randrange(len(self.train))])

    def heldout_prompts(self) -> list[Prompt]:
        return [self.make_prompt(s, t) for s, t in self.test]

    def validation_prompts(self) -> list[Prompt]:
        return [self.make_prompt(s, t) for s, t in self.validation]

    def make_env(self, prompt: Prompt, reward_fn: RewardFunction) -> ReachTargetEnv:
        return ReachTargetEnv(int(prompt.metadata["start"]), int(prompt.metadata["target"]), self.max_moves)

    def episode_turns(self) -> int:
        return self.max_moves
