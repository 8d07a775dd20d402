"""The generative critic: the policy's own weights, given a critic instruction and an episode's history, emit one
token of a fixed value grid (TEMPO's generative critic, AC2's value token; docs/algorithms.md, TEMPO and AC2).
TEMPO and AC2 share it. It reads the policy itself (``weights="shared"``), a copy of the warm start (``"own"``), or
LoRA adapters of its own on the policy's frozen base (``"adapter"``, with ``model.init_args.lora``).

* the context is ``instruction + history + privileged + query`` (ids): ``history`` the episode so far (its first
  observation, actions and observations), ``privileged`` optional text only the critic sees (``str.format`` over
  the prompt's ``answer`` and ``metadata``, e.g. ``" s={secret}"``); a history too long for the model's positions
  keeps its last ids;
* its value is ``V = Σ_k p_k v_k`` over the grid (``functional.value_from_grid``): one forward row per context
  through ``RLModule.candidate_logprobs``, the distribution restricted to the ``K`` grid ids (default 11 letters
  ``a``..``k`` for ``v_k`` evenly spaced on ``value_range``);
* it learns on auxiliary rows (``RLModule.auxiliary_rows``), merged into the policy's update: ``ce_rows``, the
  cross-entropy to the target's nearest bin (``functional.nearest_bin``, ``value_token_ce``: AC2), or
  ``accuracy_rows``, TEMPO's GRPO on sampled value tokens rewarded by ``-|V̂ - y| / (R_max - R_min)`` centred
  within each state's group (``functional.accuracy_advantages``);
* a method calls it at segment boundaries only (``values`` counts the contexts it valued in ``calls``);
* ``reasoning_tokens > 0`` (for real models; TEMPO's critic may reason over the history): the context ends with
  ``reasoning_prompt`` instead of the query, the policy writes up to that many tokens there (greedy, eval mode, no
  gradient, stopped at EOS, which is dropped), and the query follows them; the value token is read, and trained,
  after that reasoning, which is context (it is not trained itself). Tools are not implemented.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import Tensor, nn

from rl_lightning.algorithms.auxiliary import AuxiliaryRows
from rl_lightning.algorithms.forward import sequences_batch
from rl_lightning.algorithms.metrics import Summed
from rl_lightning.algorithms.planning import rollout_weights
from rl_lightning.envs.base import Prompt
from rl_lightning.models.adapters import AdapterView, adapter_parameters, add_adapter
from rl_lightning.rollout.engine import SamplingParams
from rl_lightning.rollout.engines import KVCacheEngine
from rl_lightning.functional import (
    accuracy_advantages, aggregate, clipped_surrogate, nearest_bin, value_from_grid, value_levels, value_token_ce,
)

#: ``RolloutBatch.extras`` keys of the critic's auxiliary rows
BIN, ADVANTAGE = "value_bin", "critic_advantage"


def value_token_ids(tokenizer: Any, tokens: tuple[str, ...], owner: str) -> list[int]:
    """The id of each value token; refuses, naming ``value_tokens``, tokens that are not exactly one known id of
    ``tokenizer`` or that share an id."""
    ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in tokens]
    bad = [t for t, i in zip(tokens, ids) if len(i) != 1 or i[0] == tokenizer.unk_token_id]
    if bad:
        raise ValueError(f"{owner}: value_tokens {bad} are not single tokens of the tokenizer")
    flat = [i[0] for i in ids]
    if len(set(flat)) != len(flat):
        raise ValueError(f"{owner}: value_tokens {list(tokens)} do not encode to distinct ids ({flat})")
    return flat


def start_history(batch: Any, row: int) -> list[int]:
    """The ids of a branch row's starting state: the prompt part (its first observation and the branch's prefix)."""
    p = batch.prompt_length
    return batch.input_ids[row, :p][batch.attention_mask[row, :p].bool()].tolist()


def end_history(batch: Any, row: int) -> list[int]:
    """The ids of a row's end state: everything it attended to, then a final observation a limit kept out."""
    ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
    end = batch.ends.states[row] if batch.ends is not None else None
    return ids + (list(end.final_obs_ids) if end is not None else [])


class GenerativeCritic:
    """A value-token critic on the policy's weights (see the module docstring).

    Args:
        value_tokens: the grid, lowest value first; each exactly one token of the policy's tokenizer.
        value_range: ``[R_min, R_max]``, spanned evenly by the grid.
        query: text after the history (and the privileged text), right before the value token.
        instruction: text before the history (a real model's critic instruction; ``""`` on the embedded models,
            whose 64 positions the history needs).
        privileged: text in the critic's context only, ``str.format`` over the prompt's ``answer`` and ``metadata``
            (``None``: none).
        reasoning_tokens: tokens the policy may write before the query (0: none; see the module docstring).
        reasoning_prompt: text that opens the reasoning (with ``reasoning_tokens > 0``).
        weights: ``"shared"``: the critic is the policy itself (its value tokens are trained on the actor's weights);
            ``"own"``: a copy of the initial policy that only the critic reads and trains (``attach``), so value-token
            training cannot pull the actor's outputs towards the value tokens (docs/algorithms.md, TEMPO);
            ``"adapter"``: LoRA adapters of its own (``ADAPTER``) on the LoRA policy's frozen base, with the policy's
            LoRA settings: the same separation as ``"own"`` without a second model (the policy needs ``lora``).
    """

    #: the name of the critic's adapters with ``weights="adapter"``
    ADAPTER = "critic"


    def __init__(self, value_tokens: tuple[str, ...] = tuple("abcdefghijk"),
                 value_range: tuple[float, float] = (0.0, 1.0), query: str = " V:", instruction: str = "",
                 privileged: str | None = None, reasoning_tokens: int = 0,
                 reasoning_prompt: str = " Think:", weights: Literal["shared", "own", "adapter"] = "shared") -> None:
        if len(value_tokens) < 2 or len(value_range) != 2 or not value_range[0] < value_range[1]:
            raise ValueError(f"GenerativeCritic: needs >= 2 value_tokens and value_range [R_min, R_max] with "
                             f"R_min < R_max, got {list(value_tokens)}, {list(value_range)}")
        self.value_tokens, self.value_range = tuple(value_tokens), (float(value_range[0]), float(value_range[1]))
        self.query, self.instruction, self.privileged = query, instruction, privileged
        if reasoning_tokens < 0:
            raise ValueError(f"GenerativeCritic: reasoning_tokens must be >= 0, got {reasoning_tokens}")
        self.reasoning_tokens, self.reasoning_prompt = reasoning_tokens, reasoning_prompt
        if weights not in ("shared", "own", "adapter"):
            raise ValueError(f"GenerativeCritic: weights must be 'shared', 'own' or 'adapter', got {weights!r}")
        self.weights = weights
        #: what the critic reads unless shared (``attach``): its copy of the policy, or a view of its adapters
        self.model: nn.Module | None = None
        self.calls = 0  # contexts valued by ``values``

    def attach(self, policy: nn.Module) -> nn.Module | None:
        """Give the critic its weights; returns the module the method registers as a submodule (so it is
        checkpointed, moved and optimised: ``parameter_groups``, listed in ``trainable_parameters``), if any.

        ``"own"``: a copy of ``policy`` (as it is now: the warm start), returned. ``"adapter"``: adapters ``ADAPTER``
        added to ``policy`` (``models.adapters.add_adapter``; they are checkpointed with it), read through an
        ``AdapterView``; ``None`` is returned. ``"shared"``: nothing; ``None``."""
        if self.weights == "adapter":
            add_adapter(policy, self.ADAPTER)
            self.model = AdapterView(policy, self.ADAPTER)
            return None
        self.model = copy.deepcopy(policy) if self.weights == "own" else None
        return self.model

    def parameter_groups(self) -> list[dict[str, Any]]:
        """The optimiser group of the critic's own weights or adapters (``[]`` when shared), the policy's
        settings."""
        if self.model is None:
            return []
        params = (adapter_parameters(self.model.target, self.ADAPTER) if isinstance(self.model, AdapterView)
                  else list(self.model.parameters()))
        return [{"params": params, "name": "critic"}]

    def network(self, module: Any) -> nn.Module:
        """The model the critic reads: its own (``"own"``), its adapters' view (``"adapter"``) or the policy."""
        self._check_attached(module)
        return module.policy if self.model is None else self.model

    def _check_attached(self, module: Any) -> None:
        if self.weights != "shared" and self.model is None:
            raise ValueError(f"{type(module).__name__}: GenerativeCritic(weights={self.weights!r}) was never given its "
                             "weights: "
                             "the method must call critic.attach(policy) and optimise critic.parameter_groups() "
                             "(TEMPO does)")

    def grid_ids(self, tokenizer: Any) -> list[int]:
        return value_token_ids(tokenizer, self.value_tokens, "GenerativeCritic")

    def levels(self, device: torch.device | str | None = None) -> Tensor:
        """``[K]`` the grid's values."""
        return value_levels(*self.value_range, len(self.value_tokens), device)

    def context(self, module: Any, history: list[int], prompt: Prompt | None = None) -> list[int]:
        """``instruction + history + privileged + query`` ids, the history cut from the left to leave one position
        (the value token) within the policy's ``max_position_embeddings``; with ``reasoning_tokens``, ending with
        ``reasoning_prompt`` and leaving room for the reasoning and the query (``reasoned`` completes it)."""
        tok = module.tokenizer
        encode = lambda text: list(tok(text, add_special_tokens=False)["input_ids"]) if text else []  # noqa: E731
        extra = self.privileged.format(answer=prompt.answer, **prompt.metadata) if self.privileged and prompt else ""
        head, tail = encode(self.instruction), encode(extra) + encode(self.query)
        reserve = 0
        if self.reasoning_tokens:
            tail, reserve = (encode(extra) + encode(self.reasoning_prompt),
                             self.reasoning_tokens + len(encode(self.query)))
        limit = getattr(getattr(module.policy, "config", None), "max_position_embeddings", None)
        room = len(history) if limit is None else max(limit - 1 - reserve - len(head) - len(tail), 1)
        return head + list(history)[-room:] + tail

    def start_contexts(self, module: Any, batch: Any) -> tuple[list[int], list[list[int]]]:
        """``(rows, contexts)``: the first row of each group of a branch batch and the critic's context at its
        starting state (``start_history``: the group's shared prompt part)."""
        starts = list(range(0, batch.num_rows, batch.group_size))
        return starts, [self.context(module, start_history(batch, r), batch.prompts[r]) for r in starts]

    @torch.no_grad()
    def reasoned(self, module: Any, contexts: list[list[int]]) -> list[list[int]]:
        """``contexts`` (from ``context``) completed by the policy's reasoning and the query; themselves when
        ``reasoning_tokens`` is 0."""
        if not self.reasoning_tokens:
            return contexts
        tok, policy = module.tokenizer, self.network(module)
        params = SamplingParams(max_tokens=self.reasoning_tokens, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id, greedy=True)
        was = policy.training
        policy.eval()
        try:
            gen = KVCacheEngine().bound(policy).generate(contexts, params)
        finally:
            policy.train(was)
        query = list(tok(self.query, add_special_tokens=False)["input_ids"])
        out = []
        for c, ids, mask in zip(contexts, gen.response_ids.tolist(), gen.mask.tolist()):
            thought = [i for i, m in zip(ids, mask) if m and i != tok.eos_token_id]
            out.append(list(c) + thought + query)
        return out

    def logprobs(self, module: Any, contexts: list[list[int]]) -> Tensor:
        """``[C, K]`` next-token log-probs of the grid ids after each context (``reasoned`` first), with gradient
        when enabled."""
        return self._grid_logprobs(module, self.reasoned(module, contexts))

    def _grid_logprobs(self, module: Any, full: list[list[int]]) -> Tensor:
        return module.candidate_logprobs(full, self.grid_ids(module.tokenizer), model=self.network(module))

    @torch.no_grad()
    def values(self, module: Any, contexts: list[list[int]]) -> Tensor:
        """``[C]`` ``V̂`` of each context, detached (``functional.value_from_grid``); counted in ``calls``."""
        self.calls += len(contexts)
        return value_from_grid(self.logprobs(module, contexts), self.levels(module.device))

    def _rows(self, module: Any, contexts: list[list[int]], bins: Tensor, coef: float, **extras: Tensor) -> Any:
        self._check_attached(module)
        grid = torch.tensor(self.grid_ids(module.tokenizer), device=module.device)
        rows = sequences_batch(contexts, [[int(grid[b])] for b in bins.tolist()], None,
                               module.tokenizer.pad_token_id, 1.0, module.device)
        rows = replace(rows, extras={BIN: bins.to(module.device),
                                     **{k: v.to(module.device) for k, v in extras.items()}})
        weights = rollout_weights(rows, "token_mean", module.ranks) * coef  # the mean over every rank's rows
        return rows, weights, grid.expand(len(contexts), 1, grid.numel())

    def ce_rows(self, module: Any, contexts: list[list[int]], targets: Tensor, coef: float = 1.0,
                metric: str = "train/critic_loss") -> AuxiliaryRows:
        """Auxiliary rows training ``coef · mean_c CE(nearest_bin(target_c))`` (``functional.value_token_ce``)."""
        bins = nearest_bin(targets.detach().cpu(), self.levels())
        rows, weights, ids = self._rows(module, self.reasoned(module, contexts), bins, coef)

        def loss(rows: Any, out: Any, w: Tensor) -> tuple[Tensor, dict]:
            ce = value_token_ce(out.extra_logprobs[:, 0], rows.extras[BIN])
            term = aggregate(ce.unsqueeze(1) * rows.loss_mask, w)
            return term, {metric: Summed(term.detach())}
        return AuxiliaryRows(rows, weights, loss, extra_ids=ids, model=self.model)

    def accuracy_rows(self, module: Any, contexts: list[list[int]], targets: Tensor, samples: int,
                      generator: torch.Generator, coef: float = 1.0, clip_eps: float = 0.2, scale: bool = False,
                      std_eps: float = 1e-6,
                      metric: str = "train/critic_loss") -> tuple[AuxiliaryRows, dict[str, Tensor]]:
        """TEMPO's critic rows: ``samples`` value tokens per context drawn from the grid-restricted distribution
        (``generator``, on the CPU), each rewarded ``-|v - y| / (R_max - R_min)`` for its context's target ``y``,
        centred within the context's group (``functional.accuracy_advantages``), under GRPO's clipped surrogate
        ``coef · mean(-min(ρA, clip(ρ)A))`` with ``ρ`` against the distribution they were drawn from.

        Returns the rows and, per context (``[C]``), ``critic_value`` (``V̂``) and ``critic_reward`` (mean reward)."""
        full = self.reasoned(module, contexts)
        with torch.no_grad():
            old = torch.log_softmax(self._grid_logprobs(module, full).float(), dim=-1).cpu()  # [C, K]
        drawn = torch.multinomial(old.exp(), samples, replacement=True, generator=generator)  # [C, m]
        levels = self.levels()
        y = targets.detach().float().cpu().repeat_interleave(samples)
        rewards, adv = accuracy_advantages(levels[drawn].flatten(), y, samples, *self.value_range, scale, std_eps)
        bins = drawn.flatten()
        rows, weights, ids = self._rows(module, [c for c in full for _ in range(samples)], bins, coef,
                                        **{ADVANTAGE: adv})
        rows = replace(rows, sampler_logprobs=old.gather(1, drawn).reshape(-1, 1).to(module.device))

        def loss(rows: Any, out: Any, w: Tensor) -> tuple[Tensor, dict]:
            new = torch.log_softmax(out.extra_logprobs[:, 0].float(), dim=-1).gather(1, rows.extras[BIN].unsqueeze(1))
            ratio = torch.exp(new - rows.sampler_logprobs)
            objective = clipped_surrogate(ratio, rows.extras[ADVANTAGE].unsqueeze(1), clip_eps, clip_eps)
            term = -aggregate(objective * rows.loss_mask, w)
            return term, {metric: Summed(term.detach())}
        stats = {"critic_value": value_from_grid(old, levels), "critic_reward": rewards.view(-1, samples).mean(dim=1)}
        return AuxiliaryRows(rows, weights, loss, extra_ids=ids, model=self.model), stats
