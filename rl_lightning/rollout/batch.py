"""Typed containers passed between the stages of a step: prompts in, rollouts out.

Shapes: ``N`` rows (= prompts × ``group_size``; groups are contiguous), ``P`` prompt positions (left-padded),
``T`` response positions (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from torch import Tensor

from rl_lightning.envs.base import Prompt

if TYPE_CHECKING:
    from rl_lightning.rollout.generation import Generation

Split = Literal["train", "val"]


@dataclass
class PromptBatch:
    """What the data loader yields: prompts, not tensors. Rollouts are generated from it on the device.

    Attributes:
        split: ``"train"`` (sampled, ``group_size`` responses each) or ``"val"`` (greedy, one each).
        step: the training stream position this batch was drawn at (``-1`` for validation).
        indices: stream (or held-out) index of each prompt.
        prompts: the prompts, one per index.
    """

    split: Split
    step: int
    indices: list[int]
    prompts: list[Prompt]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PromptBatch:  # noqa: ARG002
        return self  # nothing to move: generation happens after the transfer


@dataclass(frozen=True)
class StepRequest:
    """What the training loader yields: the stream step whose rollout is due. The data module makes that rollout
    when Lightning hands the request over (``RolloutDataModule.on_after_batch_transfer``, right before
    ``training_step``) and draws the step's prompts then, not when the loader prefetches the request a step
    ahead, so prompt weights a method sets in step ``k - 1`` decide step ``k``'s draw."""

    step: int

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StepRequest:  # noqa: ARG002
        return self  # nothing to move


@dataclass(frozen=True)
class EndState:
    """Where an episode that was cut (not terminated) stopped: everything needed to continue it without replaying
    it (``BranchRollout``'s ``Branch.from_rollout(batch, row)``).

    Attributes:
        env_state: the environment's ``snapshot()`` after the episode's last step.
        prefix_ids: every id after the first observation up to the end: a branch's own prefix, the row's sampled and
            observation ids, and the final observation that a limit kept out of the trajectory (``final_obs_ids``).
        pending_ids: the ids of a turn the token budget cut before it ended (a suffix of ``prefix_ids``; not yet
            seen by the environment), ``[]`` when the last turn ended.
        turns: ``(action, observation)`` texts of the turns the environment saw, the final observation included.
        final_obs_ids: the ids of the observation a limit left out of the trajectory (``[]``: none).
        snapshot_error: why ``env_state`` is missing when the environment's ``snapshot()`` raised (``None``: it did
            not); such a row cannot be continued.
    """

    env_state: Any
    prefix_ids: list[int]
    pending_ids: list[int] = field(default_factory=list)
    turns: list[tuple[str, str]] = field(default_factory=list)
    final_obs_ids: list[int] = field(default_factory=list)
    snapshot_error: str | None = None

    def to_state(self) -> dict[str, Any]:
        """Plain values only (a checkpoint loads with ``weights_only=True`` if ``env_state`` is plain too)."""
        return {"env_state": self.env_state, "prefix_ids": list(self.prefix_ids), "pending_ids": list(self.pending_ids),
                "turns": [list(t) for t in self.turns], "final_obs_ids": list(self.final_obs_ids),
                "snapshot_error": self.snapshot_error}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EndState:
        return cls(**{**state, "turns": [tuple(t) for t in state["turns"]]})


@dataclass(frozen=True)
class EpisodeEnds:
    """How each row's episode ended, as the built-in strategies record it: whether the environment ended it, and
    where each cut one stopped (what ``Branch.from_rollout(batch, row)`` continues from).

    Attributes:
        terminated: ``[N]`` bool, True where the environment ended the episode (its ``step`` returned
            ``terminated``, or it raised under ``env_errors: fail_episode``): the return is complete and the end
            state has value 0. False where the episode was *cut*: by ``max_turns``, a token budget, or the
            environment's ``truncated`` (the batch's ``truncated`` marks these too, and also a terminated episode
            whose last turn had no EOS).
        states: per row, an ``EndState`` where the episode was cut, ``None`` where it terminated.
    """

    terminated: Tensor
    states: list[EndState | None]

    @property
    def cut(self) -> Tensor:
        """``[N]`` bool: the episodes that did not terminate (``~terminated``)."""
        return ~self.terminated

    def select(self, rows: Tensor) -> EpisodeEnds:
        return EpisodeEnds(self.terminated[rows], [self.states[i] for i in rows.tolist()])

    @classmethod
    def concat(cls, ends: list[EpisodeEnds]) -> EpisodeEnds:
        return cls(torch.cat([e.terminated for e in ends]), [s for e in ends for s in e.states])


@dataclass(frozen=True)
class SamplerRecord:
    """What the sampler recorded at each generated position besides the sampled token's log-prob: the data
    module's ``record`` settings (docs/architecture.md). Each tensor is ``None`` unless asked for, and 0 at
    positions that were not sampled (padding, observations).

    Attributes:
        topk_ids, topk_logprobs: ``[N, T, k]`` the sampling distribution's k most likely ids and their log-probs,
            normalised over the full vocabulary, most likely first (``record.topk``; Score Centering).
        aux_ids: ``[N, T, K]`` K extra draws from the sampling distribution, independent of the sampled token
            (``record.aux_draws``; StableReinforce).
    """

    topk_ids: Tensor | None = None
    topk_logprobs: Tensor | None = None
    aux_ids: Tensor | None = None

    @classmethod
    def of(cls, gen: Any) -> SamplerRecord:
        """The record of an engine's ``Generation`` (or an episode generation): its fields of the same names."""
        return cls(*(getattr(gen, f.name, None) for f in fields(cls)))

    def tensors(self) -> dict[str, Tensor]:
        """The recorded tensors by name (the ones not ``None``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def map(self, fn: Callable[[Tensor], Tensor]) -> SamplerRecord:
        """The record with ``fn`` applied to every recorded tensor (move, slice, cut)."""
        return replace(self, **{name: fn(value) for name, value in self.tensors().items()})


def _widen(value: Tensor, width: int, fill: float, left: bool = False) -> Tensor:
    """``value`` (``[N, W, ...]``) padded with ``fill`` to ``width`` columns, on the right (``left``: the left)."""
    extra = width - value.shape[1]
    if extra == 0:
        return value
    pad = value.new_full((value.shape[0], extra, *value.shape[2:]), fill)
    return torch.cat([pad, value] if left else [value, pad], dim=1)


@dataclass(frozen=True)
class Turns:
    """The turn structure of multi-turn episodes, as the built-in strategies lay it out (``GroupRollout`` with
    ``max_turns > 1``, ``BranchRollout``): where the observations are, which turn each generated token belongs to,
    and what each turn earned. A single-turn batch has none (``RolloutBatch.turns`` is ``None``).

    Attributes:
        obs_mask: ``[N, T]`` 1 on observation tokens (context, never loss), 0 elsewhere.
        index: ``[N, T]`` the turn (0, 1, ...) of every model-generated token, -1 elsewhere (observations,
            padding).
        count: ``[N]`` model turns of each episode.
        rewards: ``[N, K]`` the reward of each turn (``K``: the most turns of any row), NaN after the episode's
            last; ``RolloutBatch.rewards`` is their sum.
    """

    obs_mask: Tensor
    index: Tensor
    count: Tensor
    rewards: Tensor

    def tensors(self) -> dict[str, Tensor]:
        """The tensors by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def map(self, fn: Callable[[Tensor], Tensor]) -> Turns:
        """The turns with ``fn`` applied to every tensor (move, slice)."""
        return Turns(**{name: fn(value) for name, value in self.tensors().items()})

    def select(self, rows: Tensor) -> Turns:
        """The turns of ``rows`` (a 1-D index tensor)."""
        return self.map(lambda value: value[rows])

    @classmethod
    def concat(cls, turns: list[Turns], width: int) -> Turns:
        """The rows of ``turns`` in order: ``obs_mask`` right-padded with 0 and ``index`` with -1 to ``width``
        response positions, ``rewards`` with NaN to the most turns."""
        most = max(x.rewards.shape[1] for x in turns)
        return cls(obs_mask=torch.cat([_widen(x.obs_mask, width, 0) for x in turns]),
                   index=torch.cat([_widen(x.index, width, -1) for x in turns]),
                   count=torch.cat([x.count for x in turns]),
                   rewards=torch.cat([_widen(x.rewards, most, float("nan")) for x in turns]))


# Per-row tensors whose first dimension is N, moved and sliced together. Optional ones may be None.
_ROW_TENSORS = (
    "input_ids", "attention_mask", "loss_mask", "sampler_logprobs", "rewards", "prompt_index", "truncated",
    "ref_logprobs", "proximal_logprobs", "prompt_id",
)


@dataclass(frozen=True)
class RolloutBatch:
    """Every tensor of one rollout step.

    Attributes:
        input_ids: ``[N, P+T]`` prompt tokens (left-padded) followed by response tokens (right-padded).
        attention_mask: ``[N, P+T]`` 1 on real tokens (prompt, generated, and observation tokens).
        prompt_length: ``P``; response position ``t`` is column ``P + t`` of ``input_ids``.
        loss_mask: ``[N, T]`` 1 on model-generated tokens (EOS included), 0 on padding and observations.
        sampler_logprobs: ``[N, T]`` log-prob of each generated token under the sampler's distribution.
        rewards: ``[N]`` scalar reward per response.
        group_size: ``G``; rows ``[g*G, (g+1)*G)`` answer the same prompt.
        prompt_index: ``[N]`` stream index of each row's prompt (for per-prompt state; a ``BranchRollout`` row:
            its branch's ``prompt_index``, -1 for a branch that has none).
        truncated: ``[N]`` bool, True when the response hit ``max_new_tokens`` without EOS (episodes: a turn or
            token limit ended it, or its environment truncated it).
        temperature, top_p: the sampler's settings; the learner scores tokens under the same distribution.
        prompts, responses: ``N`` prompts and decoded responses (for rewards, logging and error messages).
        ref_logprobs: ``[N, T]`` reference-model log-probs, filled in by a KL callback when needed.
        proximal_logprobs: ``[N, T]`` the learner's log-probs before this batch's update (the proximal policy of a
            decoupled objective, e.g. GRPO with truncated importance sampling), filled in by ``RLModule.update``
            for a method that declares ``needs_proximal_logprobs`` when the update takes several optimiser steps.
        record: what the sampler recorded beyond each token's log-prob (``SamplerRecord``: top-k ids and
            log-probs, auxiliary draws), each tensor ``None`` unless the data module's ``record`` settings ask.
        turns: the turn structure of multi-turn episodes (``Turns``: ``obs_mask`` on observation tokens, the
            ``index`` of each generated token's turn, the ``count`` of turns and each turn's ``rewards``); ``None``
            for a single-turn batch.
        prompt_id: ``[N]`` a stable id of each row's prompt (``Prompt.uid``: the same whenever it is drawn).
        ends: how each episode ended (``EpisodeEnds``: ``terminated``, the ``EndState`` of each cut one, ``cut``).
            Set by the built-in strategies; ``None`` from a batch made otherwise.
        env_errors: episodes ended because their environment raised (``GroupRollout(env_errors="fail_episode")``).
        extras: per-row tensors (first dimension ``N``) a method or callback attaches; they follow ``to`` and
            ``select`` like the fields above.
        rollout_time, reward_time: seconds spent generating and scoring this batch.
    """

    input_ids: Tensor
    attention_mask: Tensor
    prompt_length: int
    loss_mask: Tensor
    sampler_logprobs: Tensor
    rewards: Tensor
    group_size: int
    prompt_index: Tensor
    truncated: Tensor
    temperature: float = 1.0
    top_p: float = 1.0
    prompts: list[Prompt] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    ref_logprobs: Tensor | None = None
    proximal_logprobs: Tensor | None = None
    record: SamplerRecord = field(default_factory=SamplerRecord)
    turns: Turns | None = None
    prompt_id: Tensor | None = None
    ends: EpisodeEnds | None = None
    env_errors: int = 0
    extras: dict[str, Tensor] = field(default_factory=dict)
    rollout_time: float = 0.0
    reward_time: float = 0.0

    def __post_init__(self) -> None:
        n, width = self.input_ids.shape
        t = width - self.prompt_length
        expect = {
            "attention_mask": (n, width), "loss_mask": (n, t), "sampler_logprobs": (n, t), "rewards": (n,),
            "prompt_index": (n,), "truncated": (n,), "ref_logprobs": (n, t), "proximal_logprobs": (n, t),
            "prompt_id": (n,),
        }
        for name, shape in expect.items():
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(value.shape)}, expected {shape}")
        for name, value in self.record.tensors().items():
            if value.dim() != 3 or tuple(value.shape[:2]) != (n, t):
                raise ValueError(f"RolloutBatch.record.{name} has shape {tuple(value.shape)}, expected ({n}, {t}, k)")
        if self.turns is not None:
            for name, shape in (("obs_mask", (n, t)), ("index", (n, t)), ("count", (n,))):
                value = getattr(self.turns, name)
                if tuple(value.shape) != shape:
                    raise ValueError(f"RolloutBatch.turns.{name} has shape {tuple(value.shape)}, expected {shape}")
            rewards = self.turns.rewards
            if rewards.dim() != 2 or rewards.shape[0] != n:
                raise ValueError(f"RolloutBatch.turns.rewards has shape {tuple(rewards.shape)}, expected ({n}, K)")
        for name, value in self.extras.items():
            if value.shape[:1] != (n,):
                raise ValueError(f"RolloutBatch.extras[{name!r}] has shape {tuple(value.shape)}, expected ({n}, ...)")
        if self.ends is not None and (tuple(self.ends.terminated.shape) != (n,) or len(self.ends.states) != n):
            raise ValueError(f"RolloutBatch.ends has {tuple(self.ends.terminated.shape)} terminated flags and "
                             f"{len(self.ends.states)} states, expected {n} of each")
        if self.group_size < 1 or n % self.group_size:
            raise ValueError(f"RolloutBatch: group_size={self.group_size} does not divide N={n}")

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_ids(self) -> Tensor:
        """``[N, T]`` the response part of ``input_ids``."""
        return self.input_ids[:, self.prompt_length:]

    @property
    def response_lengths(self) -> Tensor:
        """``[N]`` number of model-generated tokens per row."""
        return self.loss_mask.sum(dim=1)

    @classmethod
    def from_generation(
        cls, prompt_ids: Tensor, prompt_mask: Tensor, gen: Generation, *, rewards: Tensor, group_size: int,
        prompt_index: Tensor, temperature: float, top_p: float, **fields: Any,
    ) -> RolloutBatch:
        """The batch of left-padded prompts ``[N, P]`` followed by an engine's ``Generation`` (``[N, T]``).

        ``input_ids``/``attention_mask`` are prompt and response side by side, ``loss_mask`` is the
        generation's mask (EOS included), ``sampler_logprobs`` its recorded log-probs, ``record`` what else it
        recorded (``SamplerRecord.of``); ``fields`` sets any other field (texts, timings, optional tensors).
        """
        observed = getattr(gen, "obs_mask", None)  # episodes: observation ids are context too
        response_attention = gen.mask if observed is None else (gen.mask.bool() | observed.bool()).long()
        return cls(
            input_ids=torch.cat([prompt_ids, gen.response_ids], dim=1),
            attention_mask=torch.cat([prompt_mask, response_attention], dim=1),
            prompt_length=prompt_ids.shape[1],
            loss_mask=gen.mask,
            sampler_logprobs=gen.logprobs,
            rewards=rewards,
            group_size=group_size,
            prompt_index=prompt_index,
            truncated=gen.truncated,
            temperature=temperature,
            top_p=top_p,
            record=SamplerRecord.of(gen),
            **fields,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RolloutBatch:
        def move(value: Tensor) -> Tensor:
            return value.to(device, non_blocking=non_blocking)

        moved = {name: move(getattr(self, name)) for name in _ROW_TENSORS if getattr(self, name) is not None}
        ends = None if self.ends is None else replace(self.ends, terminated=move(self.ends.terminated))
        return replace(self, **moved, extras={k: move(v) for k, v in self.extras.items()}, record=self.record.map(move),
                       turns=None if self.turns is None else self.turns.map(move), ends=ends)

    def select(self, rows: Tensor) -> RolloutBatch:
        """The sub-batch of ``rows`` (a 1-D index tensor). ``group_size`` becomes 1 unless whole groups are kept."""
        picked = {name: getattr(self, name)[rows] for name in _ROW_TENSORS if getattr(self, name) is not None}
        idx = rows.tolist()
        g = self.group_size
        whole_groups = len(idx) % g == 0 and all(
            idx[k] % g == 0 and idx[k:k + g] == list(range(idx[k], idx[k] + g)) for k in range(0, len(idx), g)
        )
        return replace(
            self,
            **picked,
            group_size=g if whole_groups else 1,
            extras={k: v[rows] for k, v in self.extras.items()},
            record=self.record.map(lambda v: v[rows]),
            turns=self.turns.select(rows) if self.turns is not None else None,
            prompts=[self.prompts[i] for i in idx] if self.prompts else [],
            responses=[self.responses[i] for i in idx] if self.responses else [],
            ends=self.ends.select(rows) if self.ends is not None else None,
        )

    @classmethod
    def concat(cls, batches: list[RolloutBatch], pad_id: int = 0) -> RolloutBatch:
        """One batch of ``batches``' rows in order (single- and multi-turn alike), e.g. rounds of dynamic sampling.

        The prompt part of ``input_ids``/``attention_mask`` is left-padded to the longest prompt (``pad_id``,
        attention 0), every per-token field right-padded to the widest response (``turns.index`` with -1, the
        rest, ``record`` and ``turns.obs_mask`` included, with 0), ``turns.rewards`` to the most turns with NaN
        (``Turns.concat``). Row fields, texts, end states and ``extras`` (same trailing shape) are concatenated;
        ``env_errors`` and the timings add up. The batches must share ``group_size``, ``temperature`` and
        ``top_p``, and record the same optional fields.
        """
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        first = batches[0]
        for b in batches[1:]:
            for name in ("group_size", "temperature", "top_p"):
                if getattr(b, name) != getattr(first, name):
                    raise ValueError(f"RolloutBatch.concat: {name} differs "
                                     f"({getattr(b, name)} vs {getattr(first, name)})")
            for name in (*_ROW_TENSORS, "turns", "ends"):
                if (getattr(b, name) is None) != (getattr(first, name) is None):
                    raise ValueError(f"RolloutBatch.concat: {name} is recorded in some batches and not in others")
            if set(b.extras) != set(first.extras):
                raise ValueError("RolloutBatch.concat: the batches carry different extras")
            if set(b.record.tensors()) != set(first.record.tensors()):
                raise ValueError("RolloutBatch.concat: the batches record different sampler outputs (record)")
        p = max(b.prompt_length for b in batches)
        t = max(b.input_ids.shape[1] - b.prompt_length for b in batches)

        def sides(b: RolloutBatch, name: str, fill: int) -> Tensor:
            value = getattr(b, name)
            prompt, response = value[:, :b.prompt_length], value[:, b.prompt_length:]
            return torch.cat([_widen(prompt, p, fill, left=True), _widen(response, t, 0)], dim=1)

        joined: dict[str, Any] = {"input_ids": torch.cat([sides(b, "input_ids", pad_id) for b in batches]),
                                  "attention_mask": torch.cat([sides(b, "attention_mask", 0) for b in batches])}
        for name in _ROW_TENSORS:
            if name in joined or getattr(first, name) is None:
                continue
            values = [getattr(b, name) for b in batches]
            if values[0].dim() >= 2:
                values = [_widen(v, t, 0) for v in values]
            joined[name] = torch.cat(values)
        return replace(
            first, **joined, prompt_length=p,
            prompts=[x for b in batches for x in b.prompts], responses=[x for b in batches for x in b.responses],
            ends=None if first.ends is None else EpisodeEnds.concat([b.ends for b in batches]),
            extras={k: torch.cat([b.extras[k] for b in batches]) for k in first.extras},
            record=SamplerRecord(**{k: torch.cat([_widen(getattr(b.record, k), t, 0) for b in batches])
                                    for k in first.record.tensors()}),
            turns=None if first.turns is None else Turns.concat([b.turns for b in batches], t),
            env_errors=sum(b.env_errors for b in batches), rollout_time=sum(b.rollout_time for b in batches),
            reward_time=sum(b.reward_time for b in batches))


_FIELD_NAMES = frozenset(f.name for f in fields(RolloutBatch))
