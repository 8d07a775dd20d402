"""The engine boundary: what turns prompt token ids into sampled tokens, and what an external engine implements.

A ``RolloutEngine`` holds the weights it samples with and is driven through four calls (the vLLM names in
brackets are where an engine built on vLLM's offline ``LLM`` or its server would map them):

* ``setup(policy, dtype, version)``, once before the first rollout: build the engine's model from the learner's
  policy, its architecture and its current weights (vLLM: the model directory, ``LLM(...)`` or a server).
* ``load_weights(named_tensors, version)``: take the learner's weights after ``version`` updates; the sampler
  sync (``rollout.sync.SamplerSync``) calls it at its sync points (``collective_rpc("reload_weights")``, then
  ``reset_prefix_cache()``).
* ``generate(prompts, params, n)``: ``n`` samples for each prompt given as token ids, under explicit
  ``SamplingParams`` (``SamplingParams(n, temperature, top_p, logprobs, seed)`` on ``TokensPrompt``s). It returns
  a ``Generation``: ids, the sampler's log-probs, finish reasons (``truncated``) and the optional extras.
* ``open_session(prompts, params)`` for multi-turn episodes: ``turn`` samples one turn for some rows, ``append``
  continues rows with observation tokens after their turn (vLLM: the history re-sent, its prefix cached).

``capabilities`` declares what an engine can do beyond single-turn sampling; the data module checks them at
setup (``check_capabilities``) and refuses a configuration that asks for more, in one line.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import Tensor, nn

from rl_lightning.rollout.generation import AUX_DRAWS, TOPK, Generation, SamplingParams  # noqa: F401

#: runs multi-turn sessions (``open_session``)
SESSIONS = "sessions"
#: generates with an ``nn.Module`` in this process: it can sample with the learner's policy itself (no copy, no
#: sync: ``bound``) or with a copy in another dtype
IN_PROCESS = "in_process"

#: ``stop(row, ids)``: whether a turn of episode ``row`` ends after the ids sampled in it so far
StopCheck = Callable[[int, list[int]], bool]
#: per sampled id of a row: (top-k ids [k], their log-probs [k], auxiliary draws [K]); each None unless asked for
TokenExtras = tuple[Tensor | None, Tensor | None, Tensor | None]


def seeded(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed`` (``None``: none, the global RNG)."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


@dataclass
class Turn:
    """One turn of a session, for the rows asked (in that order): the ids sampled, their log-probs, why the turn
    ended (``"stop"``: EOS or a stop check; ``"length"``: its budget) and, on request, per-id extras."""

    ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    extras: list[list[TokenExtras]] | None = None


class EngineSession(ABC):
    """A batch of multi-turn episodes on an engine: rows ``0 .. B-1``, each a token sequence that grows by the
    turns sampled and the observations appended. A row that is not continued (``append``) has ended."""

    @abstractmethod
    def turn(self, rows: list[int], budgets: list[int], stop: StopCheck | None = None) -> Turn:
        """Sample one turn for each of ``rows`` (at most ``budgets[i]`` ids; it ends at EOS or when ``stop``
        says so)."""

    @abstractmethod
    def append(self, rows: list[int], ids: list[list[int]]) -> None:
        """Continue ``rows`` with ``ids`` (their observations) after the turn they just sampled; every other row
        has ended and leaves the session."""


class RolloutEngine(ABC):
    """Generates rollouts from token ids with weights of its own (see the module docstring)."""

    #: what the engine can do beyond single-turn sampling: ``TOPK``, ``AUX_DRAWS``, ``SESSIONS``, ``IN_PROCESS``
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: the learner updates the engine's weights had seen (-1: not set up)
    version: int = -1

    @abstractmethod
    def setup(self, policy: nn.Module, dtype: str | None = None, version: int = 0) -> None:
        """Build the engine's model from the learner's ``policy`` (architecture and current weights, which are
        version ``version``), in ``dtype`` (``None``: the policy's own). Called before the first rollout that
        needs the engine's own weights, and again after a checkpoint is loaded (an engine already running may
        just take the weights)."""

    @abstractmethod
    def load_weights(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], version: int
                     ) -> None:
        """Replace the engine's weights by the learner's (its state dict's names) after ``version`` updates."""

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1) -> Generation:
        """``n`` samples of every prompt (token ids): ``len(prompts) * n`` rows, a prompt's ``n`` contiguous."""

    def open_session(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                     carry_cache: bool = True) -> EngineSession:
        """A multi-turn session over ``prompts`` (needs ``SESSIONS``). ``carry_cache=False`` asks an engine that
        keeps a cache across turns to re-encode the history every turn instead (a reference)."""
        raise NotImplementedError(f"{type(self).__name__} does not run multi-turn sessions")

    def weights(self) -> Mapping[str, Tensor] | None:
        """The weights the engine samples with, for a checkpoint of a lagged sampler (``None``: not readable)."""
        return None

    def close(self) -> None:
        """Release what ``setup`` started (processes, memory); the data module calls it at teardown."""

    @property
    def device(self) -> torch.device:
        """Where the tensors of its ``Generation`` are."""
        return torch.device("cpu")


def check_capabilities(engine: RolloutEngine, needs: dict[str, str]) -> None:
    """Refuse, in one line, settings that need a capability ``engine`` does not declare (``needs``: capability
    -> the setting that asks for it)."""
    missing = {cap: why for cap, why in needs.items() if cap not in engine.capabilities}
    if missing:
        asked = ", ".join(f"{why} needs '{cap}'" for cap, why in missing.items())
        raise ValueError(f"{type(engine).__name__} cannot serve this configuration: {asked}; it declares "
                         f"{sorted(engine.capabilities) or 'no capabilities'}")
