"""Hindsight critics for LVRL (docs/algorithms.md, LVRL): frozen judges that read a *completed* episode -- its
actions, its outcome, the mean outcome of its group -- and value the states between its actions, ``Ṽ_t`` for
``0 < t < T_b``. They are never trained (LVRL needs no critic training).

* ``LinearCritic`` -- the deterministic oracle of the tests: ``Ṽ_t = R̄_G + (R - R̄_G) t / T`` (equal credit per
  action); also every critic's fallback where it cannot value a row (a failed critic call falls back to linear
  interpolation);
* ``ValueTokenCritic`` -- LVRL's default: the frozen starting policy (or another local checkpoint) reads the whole
  trajectory followed by a short query naming the outcome and the boundary ``t``, and ``Ṽ_t`` is the expected value
  of its next-token distribution restricted to a fixed grid of value tokens (``"0" .. "9"`` spread over
  ``[R_min, R_max]``): one forward per boundary, no sampling, so the values are deterministic;
* ``PromptedCritic`` -- for real instruction-following models: a prompt template showing the episode, its actions
  and outcome, a short greedy generation (reasoning allowed), and a value parser taking its last ``T - 1`` numbers.

Contexts longer than the judge's positions and unparsable answers fall back to ``LinearCritic`` for that row
(``HindsightValues.read`` is False there; LVRL logs the fraction as ``train/hindsight_fallback``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rl_lightning.algorithms.forward import sequences_batch
from rl_lightning.algorithms.generative_critic import value_token_ids
from rl_lightning.functional import interpolated_values, value_from_grid
from rl_lightning.models.policy import load_policy
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.engine import SamplingParams
from rl_lightning.rollout.engines import KVCacheEngine


@dataclass(frozen=True)
class HindsightValues:
    """What a hindsight critic returns for a rollout batch.

    Attributes:
        values: ``[N, K]`` ``Ṽ_t`` at the boundaries ``0 < t < T_b`` (entry 0 and entries from ``T_b`` on are
            ignored by ``functional.anchored_credit``).
        read: ``[N]`` bool, False where the critic could not value the row and it was linearly interpolated.
    """

    values: Tensor
    read: Tensor


class HindsightCritic:
    """A frozen critic that values the boundaries between an episode's actions after the episode is over."""

    def values(self, module: Any, batch: RolloutBatch, turn_index: Tensor, turn_mask: Tensor,
               value_range: tuple[float, float]) -> HindsightValues:
        """``Ṽ_t`` of every row of ``batch`` (``turn_index [N, T]``, ``turn_mask [N, K]``: its actions), in
        ``value_range``; ``module``: the method, for its tokenizer, device and frozen copy."""
        raise NotImplementedError(f"{type(self).__name__} must implement values")


class LinearCritic(HindsightCritic):
    """``Ṽ_t = R̄_G + (R - R̄_G) t / T`` (``functional.interpolated_values``): each action gets ``(R - R̄_G) / T``."""

    def values(self, module: Any, batch: RolloutBatch, turn_index: Tensor, turn_mask: Tensor,
               value_range: tuple[float, float]) -> HindsightValues:
        values = interpolated_values(batch.rewards, batch.group_size, turn_mask)
        return HindsightValues(values, torch.ones(batch.num_rows, dtype=torch.bool, device=values.device))


class FrozenJudge(HindsightCritic):
    """A critic that reads with a frozen language model: the starting policy (``module.load_frozen_copy``) or the
    checkpoint ``model_name_or_path`` (with its own tokenizer), loaded on first use and never saved (not a
    submodule of the method, left out when pickled into ``hparams``)."""

    def __init__(self, model_name_or_path: str | None = None) -> None:
        self.model_name_or_path = model_name_or_path
        self._model: nn.Module | None = None
        self._tokenizer: Any = None

    def judge(self, module: Any, device: torch.device) -> tuple[nn.Module, Any]:
        """``(frozen model on device, its tokenizer)``."""
        if self._model is None:
            if self.model_name_or_path is None:
                self._model, self._tokenizer = module.load_frozen_copy(), module.tokenizer
            else:
                model, self._tokenizer = load_policy(self.model_name_or_path, module.hparams.dtype)
                self._model = model.requires_grad_(False).eval()
        self._model.to(device)
        return self._model, self._tokenizer

    def encode(self, tokenizer: Any, text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def positions(model: nn.Module) -> int | None:
        return getattr(getattr(model, "config", None), "max_position_embeddings", None)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_model": None, "_tokenizer": None}

    @staticmethod
    def episode(batch: RolloutBatch, row: int) -> list[int]:
        """The row's real ids: its prompt, then every action and observation (no padding)."""
        return batch.input_ids[row][batch.attention_mask[row].bool()].tolist()


class ValueTokenCritic(FrozenJudge):
    """The frozen starting policy as a hindsight critic (LVRL's default; see the module docstring).

    For each row with ``T ≥ 2`` actions and each boundary ``0 < t < T``, the context is the row's whole episode
    then ``query`` filled with ``outcome`` (``R``), ``group_mean`` (``R̄_G``: the related rollouts), ``step``
    (``t``) and ``steps`` (``T``); ``Ṽ_t = Σ_k softmax(z[grid])_k v_k`` with ``z`` the next-token logits and
    ``v_k`` the ``K`` grid values spread evenly over ``value_range`` (``"0"`` = ``R_min``, ``"9"`` = ``R_max``).
    LVRL asks for hindsight, so the whole episode and its outcome precede the query (a prefix-only value
    would be an ordinary critic). Why value tokens and not generated text for the default: the expectation over a
    fixed grid (issue 22's generative-critic design) is deterministic, needs no parser that can fail, and costs one
    forward per ``batch_size`` contexts, in which the queries of a row share its episode
    (``forward.shared_prompt_forward``); ``PromptedCritic`` is the text form for models that can reason. On the
    embedded models nothing taught the policy to judge: there its readings are a fixed, arbitrary split of the
    anchored total, which LVRL allows (its anchoring fixes the total, not a correct split over the actions); a real
    model can be given a more telling ``query``.

    Args:
        query: text after the episode (``str.format`` fields above); the default is short enough for the embedded
            guess model's 64 positions and uses only characters its tokenizer knows.
        value_tokens: the grid, each exactly one token of the judge's tokenizer.
        model_name_or_path: the judge (``None``: the frozen starting policy).
        batch_size: contexts per forward.
    """

    def __init__(self, query: str = " R={outcome:g} t={step}/{steps} V:",
                 value_tokens: tuple[str, ...] = tuple("0123456789"), model_name_or_path: str | None = None,
                 batch_size: int = 256) -> None:
        super().__init__(model_name_or_path)
        if len(value_tokens) < 2 or batch_size < 1:
            raise ValueError(f"ValueTokenCritic: needs >= 2 value_tokens and batch_size >= 1, got {value_tokens!r}, "
                             f"{batch_size}")
        self.query, self.value_tokens, self.batch_size = query, tuple(value_tokens), batch_size

    def grid_ids(self, tokenizer: Any) -> list[int]:
        return value_token_ids(tokenizer, self.value_tokens, "ValueTokenCritic")

    @torch.no_grad()
    def values(self, module: Any, batch: RolloutBatch, turn_index: Tensor, turn_mask: Tensor,
               value_range: tuple[float, float]) -> HindsightValues:
        device = batch.input_ids.device
        model, tokenizer = self.judge(module, device)
        grid = torch.tensor(self.grid_ids(tokenizer), device=device)
        levels = torch.linspace(value_range[0], value_range[1], len(self.value_tokens), device=device)
        values = interpolated_values(batch.rewards, batch.group_size, turn_mask)
        read = torch.ones(batch.num_rows, dtype=torch.bool, device=device)
        steps, means, limit = turn_mask.sum(dim=1).tolist(), values[:, 0].tolist(), self.positions(model)
        chunks: list[list[tuple[int, int, list[int], list[int]]]] = [[]]  # (row, t, episode, query), whole rows
        for row, count in enumerate(steps):
            episode, reward = self.episode(batch, row), float(batch.rewards[row])
            queries = [self.encode(tokenizer, self.query.format(outcome=reward, group_mean=means[row], step=t,
                                                                 steps=count)) for t in range(1, count)]
            if limit is not None and any(len(episode) + len(q) > limit for q in queries):
                read[row] = False  # the judge cannot read it: the row keeps its linear interpolation
                continue
            if chunks[-1] and len(chunks[-1]) + len(queries) > self.batch_size:
                chunks.append([])
            chunks[-1] += [(row, t + 1, episode, q) for t, q in enumerate(queries)]
        for chunk in filter(None, chunks):
            values[[c[0] for c in chunk], [c[1] for c in chunk]] = self.read_grid(module, model, tokenizer, chunk,
                                                                                 grid, levels)
        return HindsightValues(values, read)

    @staticmethod
    def read_grid(module: Any, model: nn.Module, tokenizer: Any, chunk: list[tuple[int, int, list[int], list[int]]],
                  grid: Tensor, levels: Tensor) -> Tensor:
        """``[n]`` ``E[v]`` after each ``episode + query`` of ``chunk``: one forward through ``module.forward_policy``
        (the episode, which a row's queries share, runs once: ``forward.shared_prompt_forward``), the log-probs at
        the grid ids read at the position after the query (a dummy target there), renormalised over the grid."""
        targets = [q + [tokenizer.pad_token_id] for *_, q in chunk]
        scored = sequences_batch([c[2] for c in chunk], targets, [[0] * len(q) + [1] for *_, q in chunk],
                                 tokenizer.pad_token_id, 1.0, grid.device)
        ids = grid.expand(len(chunk), scored.loss_mask.shape[1], grid.numel())
        out = module.forward_policy(scored, model=model, extra_ids=ids)
        after = torch.tensor([len(q) for *_, q in chunk], device=grid.device)  # the dummy's column
        logp = out.extra_logprobs[torch.arange(len(chunk), device=grid.device), after].float()  # [n, J]
        return value_from_grid(logp, levels)  # E[v] over the grid


#: ``PromptedCritic``'s default instructions (fields: ``trajectory``, ``actions``, ``outcome``, ``group_mean``,
#: ``count``, ``steps``, ``low``, ``high``)
HINDSIGHT_PROMPT = (
    "You are judging an agent's finished episode in hindsight.\n\nEpisode:\n{trajectory}\n\n"
    "The agent's {steps} actions, in order:\n{actions}\n\nFinal reward: {outcome:g} (mean over related attempts: "
    "{group_mean:g}).\nFor each of the first {count} actions, estimate the expected final reward right after that "
    "action, between {low:g} and {high:g}. Think briefly, then end your answer with the {count} numbers, separated "
    "by commas."
)
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)"


def parse_values(text: str, count: int, pattern: str = _NUMBER) -> list[float] | None:
    """The last ``count`` numbers of ``text`` (``pattern``: what a number looks like), or ``None`` if it has fewer.

    Example:
        >>> parse_values("first helps a bit, then most: 0.4, 0.9", 2)
        [0.4, 0.9]
    """
    found = re.findall(pattern, text)
    if len(found) < count:
        return None
    try:
        return [float(x) for x in found[len(found) - count:]] if count else []
    except ValueError:
        return None


class PromptedCritic(FrozenJudge):
    """An LLM asked, in words, for the values after each action of a finished episode (see the module docstring).

    One greedy generation per row with ``T ≥ 2`` actions, on the library's KV-cache engine; the answer's last
    ``T - 1`` numbers are ``Ṽ_1 .. Ṽ_{T-1}`` (``parse_values``). A row whose answer has fewer numbers, or whose
    prompt does not fit the judge, falls back to linear interpolation. Meant for a real instruction-following
    model (``model_name_or_path``: a local checkpoint; ``None`` uses the frozen starting policy); not validated
    at scale.

    Args:
        template: the prompt (``HINDSIGHT_PROMPT``'s fields).
        model_name_or_path: the judge (``None``: the frozen starting policy).
        max_new_tokens: the answer's budget (reasoning included).
        chat: wrap the prompt in the judge tokenizer's chat template when it has one.
        pattern: the regular expression of one number.
    """

    def __init__(self, template: str = HINDSIGHT_PROMPT, model_name_or_path: str | None = None,
                 max_new_tokens: int = 128, chat: bool = True, pattern: str = _NUMBER) -> None:
        super().__init__(model_name_or_path)
        if max_new_tokens < 1:
            raise ValueError(f"PromptedCritic: max_new_tokens must be >= 1, got {max_new_tokens}")
        self.template, self.max_new_tokens, self.chat, self.pattern = template, max_new_tokens, chat, pattern

    def prompt_ids(self, tokenizer: Any, text: str) -> list[int]:
        if self.chat and getattr(tokenizer, "chat_template", None):
            return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                      add_generation_prompt=True))
        return self.encode(tokenizer, text)

    @torch.no_grad()
    def values(self, module: Any, batch: RolloutBatch, turn_index: Tensor, turn_mask: Tensor,
               value_range: tuple[float, float]) -> HindsightValues:
        device = batch.input_ids.device
        model, tokenizer = self.judge(module, device)
        values = interpolated_values(batch.rewards, batch.group_size, turn_mask)
        read = torch.ones(batch.num_rows, dtype=torch.bool, device=device)
        limit, rows, prompts = self.positions(model), [], []
        for row, count in enumerate(turn_mask.sum(dim=1).tolist()):
            if count < 2:
                continue
            response = batch.response_ids[row]
            actions = [tokenizer.decode(response[turn_index[row] == t].tolist(), skip_special_tokens=True).strip()
                       for t in range(count)]
            text = self.template.format(
                trajectory=tokenizer.decode(self.episode(batch, row), skip_special_tokens=True),
                actions="\n".join(f"{t + 1}. {a}" for t, a in enumerate(actions)), outcome=float(batch.rewards[row]),
                group_mean=float(values[row, 0]), count=count - 1, steps=count, low=value_range[0], high=value_range[1])
            ids = self.prompt_ids(tokenizer, text)
            if limit is not None and len(ids) + self.max_new_tokens > limit:
                read[row] = False
                continue
            rows.append(row)
            prompts.append(ids)
        if prompts:
            params = SamplingParams(max_tokens=self.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id, greedy=True)
            gen = KVCacheEngine().bound(model).generate(prompts, params)
            for i, row in enumerate(rows):
                count = int(turn_mask[row].sum())
                answer = tokenizer.decode(gen.response_ids[i][gen.mask[i].bool()].tolist(), skip_special_tokens=True)
                parsed = parse_values(answer, count - 1, self.pattern)
                if parsed is None:
                    read[row] = False
                    continue
                values[row, 1:count] = torch.tensor(parsed, dtype=values.dtype, device=device)
        return HindsightValues(values, read)
