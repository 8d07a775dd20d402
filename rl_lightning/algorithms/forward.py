"""The learner forward: the policy's log-probs (and entropies, hidden states, log-probs at other ids) of the
generated tokens of a ``RolloutBatch``, and of arbitrary token sequences.

* ``policy_forward`` -- one forward of a batch's rows under the sampler's exact distribution (its temperature and
  top-p), only the ``T + 1`` positions that predict response tokens projected to the vocabulary;
* ``shared_prompt_forward`` -- the same outputs and gradient, running a prompt that several rows share once;
* ``sequences_batch`` -- arbitrary ``(context, target)`` token lists as a batch ``policy_forward`` scores (a second
  forward a loss may need: CoPE's forecasting, SPO's rescoring);
* ``candidate_logprobs`` -- next-token log-probs over a few candidate ids after each of many contexts, one forward
  row per context (a generative critic's value tokens: ``[contexts, candidates]``, not one row per candidate).

``RLModule.forward_policy`` and ``RLModule.score_sequences`` call these with the module's settings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor, nn

from rl_lightning.functional import sampling_logprobs, sampling_logprobs_at
from rl_lightning.models.adapters import BaseModelView, has_adapters
from rl_lightning.models.policy import load_policy
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.episodes import left_pad
from rl_lightning.rollout.generation import (
    cache_argument, can_share_prompts, distinct_rows, expandable_cache, position_ids_from_mask, repeat_cache_rows,
    returned_cache, unshareable,
)


@dataclass
class PolicyOutput:
    """The learner's view of a batch: what ``forward_policy`` returns for the rows it was given.

    Attributes:
        logprobs: ``[n, T]`` log-probs of the generated tokens (0 on padding), carrying the gradient.
        entropy: ``[n, T]`` per-token entropy of the sampling distribution (carries the gradient), if asked.
        hidden: ``[n, T, H]`` final hidden states at the positions that predict each response token (for
            value heads on the policy backbone), if asked.
        extra_logprobs: ``[n, T, J]`` log-probs at the ids ``extra_logprob_ids`` asked for (the sampler's top-k,
            auxiliary draws), from the same forward, carrying the gradient; 0 on padding, ``-inf`` at an id
            outside the top-p support (no gradient there).
    """

    logprobs: Tensor
    entropy: Tensor | None = None
    hidden: Tensor | None = None
    extra_logprobs: Tensor | None = None


def shared_prompt_forward(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_length: int, with_hidden: bool = False,
    min_tokens: int = 1,
) -> tuple[Tensor, Tensor | None] | None:
    """``(logits [n, T, V], final hidden states [n, T, H] or None)`` at the ``T`` positions ``P-1 .. P+T-2`` that
    predict the response tokens, running the prompt once per distinct prompt; ``None`` where that cannot apply.

    Rows whose first ``P - 1`` columns (ids and mask) are equal -- the ``G`` rows of a group, left-padded alike --
    share them: one forward of the distinct prefixes, with gradient, fills a KV cache whose rows are repeated to
    every row (``repeat_cache_rows``: an ``index_select``, so the backward sums the rows' gradients into the shared
    keys and values, in row order on every run), then one forward of every row's columns ``P-1 .. P+T-2`` (the
    last prompt token and the response but its last token) on that cache, with the full attention mask and
    position ids. A causal model computes exactly what one forward of the whole rows computes at these positions
    (the prefix's keys/values do not depend on what follows), so log-probs, entropies, hidden states and every
    gradient are the same up to the rounding of matrix products of other shapes and of sums taken in another
    order.

    ``None`` (the caller runs the plain forward) when sharing saves fewer than ``min_tokens`` prompt positions
    (``(n - distinct prefixes) x (P - 1)``; none when no two rows share a prefix), when ``P < 2``, when
    ``can_share_prompts`` says no (a model without a Hugging Face ``config``; dropout active in training mode,
    which would draw one mask for a group's shared prompt instead of one per row; gradient checkpointing, which
    keeps no cache), and for a model whose cache is not a plain ``DynamicCache`` (``expandable_cache``: sliding
    windows, quantised or other caches; remembered, and said once).
    """
    p = prompt_length
    if p < 2 or not can_share_prompts(model):
        return None
    shared = distinct_rows(torch.cat([input_ids[:, :p - 1], attention_mask[:, :p - 1]], dim=1))
    if shared is None or (input_ids.shape[0] - shared[0].numel()) * (p - 1) < min_tokens:
        return None
    first, inverse = shared
    positions = position_ids_from_mask(attention_mask)
    prefix = model(input_ids=input_ids[first, :p - 1], attention_mask=attention_mask[first, :p - 1],
                   position_ids=positions[first, :p - 1], use_cache=True, logits_to_keep=1)
    cache = returned_cache(prefix)
    if not expandable_cache(cache):
        unshareable(model, cache)
        return None
    del prefix
    repeat_cache_rows(cache, inverse)  # [U, ...] -> [n, ...], with a backward that sums in a fixed order
    end = input_ids.shape[1] - 1  # the last token is never an input: it predicts nothing
    out = model(input_ids=input_ids[:, p - 1:end], attention_mask=attention_mask[:, :end],
                position_ids=positions[:, p - 1:end], use_cache=True, logits_to_keep=0,
                output_hidden_states=with_hidden, **{cache_argument(model): cache})
    return out.logits, out.hidden_states[-1] if with_hidden else None


def policy_forward(
    model: nn.Module, batch: RolloutBatch, chunk_size: int, share_prompts: bool = True, share_min_tokens: int = 1,
    with_entropy: bool = False, with_hidden: bool = False, extra_ids: Tensor | None = None,
    overwrite_logits: bool = True,
) -> PolicyOutput:
    """Score the generated tokens of ``batch`` under ``model`` (see the module docstring).

    Tokens are scored under the sampler's exact distribution (its temperature and top-p), so on-policy the
    log-probs equal ``batch.sampler_logprobs``. With ``share_prompts``, rows with identical prompts run them once
    (``shared_prompt_forward``, when that saves ``share_min_tokens`` positions; the same outputs and gradient).
    ``extra_ids`` ``[N, T, J]``: also the log-probs at those ids (``PolicyOutput.extra_logprobs``,
    ``functional.sampling_logprobs_at``). ``chunk_size``: token positions per chunk of the log-softmax.
    ``overwrite_logits``: the backward writes the logits' gradient over the logits, which this function makes and
    drops (``functional.sampling_logprobs``: one ``[N, T, V]`` buffer less at the backward's peak, the same
    gradient); ``False`` for a caller that backpropagates twice through the output (``retain_graph=True``).
    """
    width = batch.input_ids.shape[1] - batch.prompt_length  # T
    shared = shared_prompt_forward(model, batch.input_ids, batch.attention_mask, batch.prompt_length,
                                   with_hidden, share_min_tokens) if share_prompts else None
    if shared is not None:
        logits, hidden = shared
    else:
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids_from_mask(batch.attention_mask),
            logits_to_keep=width + 1,
            use_cache=False,
            output_hidden_states=with_hidden,
        )
        logits = out.logits[:, :-1]  # [N, T, V]: position P-1+t predicts response token t
        start = batch.prompt_length - 1
        hidden = out.hidden_states[-1][:, start:start + width] if with_hidden else None  # [N, T, H]
    extra = None
    if extra_ids is None:
        logprobs, entropy = sampling_logprobs(
            logits, batch.response_ids, batch.temperature, batch.top_p, chunk_size, with_entropy, overwrite_logits
        )
    else:
        logprobs, extra, entropy = sampling_logprobs_at(
            logits, batch.response_ids, extra_ids, batch.temperature, batch.top_p, chunk_size, with_entropy,
            overwrite_logits,
        )
        extra = torch.where(batch.loss_mask.bool().unsqueeze(-1), extra, torch.zeros_like(extra))
    mask = batch.loss_mask.to(logprobs.dtype)
    return PolicyOutput(logprobs * mask, None if entropy is None else entropy * mask, hidden, extra)


def sequences_batch(
    contexts: list[list[int]], targets: list[list[int]], target_masks: list[list[int]] | None, pad_token_id: int,
    temperature: float, device: torch.device,
) -> RolloutBatch:
    """``targets`` after ``contexts`` (token ids) as a ``RolloutBatch`` whose response is the right-padded targets:
    contexts left-padded to the longest, ``loss_mask`` 1 on target tokens (``target_masks``, default all of them)
    and 0 on padding, sampled at ``temperature`` over the full vocabulary."""
    if len(contexts) != len(targets) or not contexts:
        raise ValueError(f"score_sequences: {len(contexts)} contexts for {len(targets)} targets")
    width_p = max(len(c) for c in contexts)
    width_t = max(1, max(len(t) for t in targets))
    n = len(contexts)
    ids = torch.full((n, width_p + width_t), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, width_p + width_t), dtype=torch.long)
    mask = torch.zeros((n, width_t), dtype=torch.long)
    for i, (context, target) in enumerate(zip(contexts, targets)):
        ids[i, width_p - len(context):width_p] = torch.tensor(context, dtype=torch.long)
        ids[i, width_p:width_p + len(target)] = torch.tensor(target, dtype=torch.long)
        attention[i, width_p - len(context):width_p + len(target)] = 1
        chosen = target_masks[i] if target_masks is not None else [1] * len(target)
        if len(chosen) != len(target):
            raise ValueError(f"score_sequences: target_masks[{i}] has {len(chosen)} entries for {len(target)} ids")
        mask[i, :len(target)] = torch.tensor(chosen, dtype=torch.long)
    return RolloutBatch(
        input_ids=ids.to(device), attention_mask=attention.to(device), prompt_length=width_p,
        loss_mask=mask.to(device), sampler_logprobs=torch.zeros(n, width_t, device=device),
        rewards=torch.zeros(n, device=device), group_size=1, prompt_index=torch.zeros(n, dtype=torch.long,
        device=device), truncated=torch.zeros(n, dtype=torch.bool, device=device), temperature=temperature)


def candidate_logprobs(model: nn.Module, contexts: list[list[int]], candidates: Tensor | list[int],
                       pad_token_id: int, temperature: float = 1.0) -> Tensor:
    """``[C, K]`` ``log π(candidate_k | context_c)`` at temperature ``temperature`` over the full vocabulary, with
    the gradient: the ``C`` contexts left-padded into one forward (position ids from the mask) that projects only
    each row's last position to the vocabulary -- one row per context whatever ``K``, where scoring each candidate
    as a one-token target (``sequences_batch``) takes ``C x K`` rows. ``candidates``: ``[K]`` ids for every context,
    or ``[C, K]`` per context. The same numbers as that path up to float32 rounding (other shapes)."""
    if not contexts or any(not c for c in contexts):
        raise ValueError("candidate_logprobs: every context needs at least one id")
    device = next(model.parameters()).device
    ids, mask = left_pad(contexts, pad_token_id, device)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False,
                   logits_to_keep=1).logits[:, -1].float()
    chosen = torch.as_tensor(candidates, device=device).long()
    chosen = chosen.expand(len(contexts), -1) if chosen.dim() == 1 else chosen
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, chosen)


@torch.no_grad()
def with_proximal_logprobs(forward: Callable[[RolloutBatch], PolicyOutput], batch: RolloutBatch,
                           micro_batch_size: int | None) -> RolloutBatch:
    """``batch`` with ``proximal_logprobs``: the learner's log-probs before the update (``forward`` of every
    micro-batch of ``micro_batch_size`` rows, no gradient), for a decoupled objective's proximal policy."""
    logprobs = torch.zeros_like(batch.sampler_logprobs)
    for micro in torch.arange(batch.num_rows, device=batch.loss_mask.device).split(micro_batch_size or batch.num_rows):
        logprobs[micro] = forward(batch.select(micro)).logprobs.float()
    return replace(batch, proximal_logprobs=logprobs)


class LearnerForward:
    """The learner forward as ``RLModule`` methods, with the module's settings (``policy``, ``tokenizer``,
    ``logprob_chunk_size``, ``share_prompt_forward``, ``share_prompt_min_tokens``, ``hparams``)."""

    #: ``policy_forward``'s ``overwrite_logits``: set it ``False`` in a subclass whose loss backpropagates twice
    #: through ``forward_policy``'s output (``retain_graph=True``), which the overwritten logits refuse loudly
    overwrite_logits: bool = True

    def load_frozen_copy(self) -> nn.Module:
        """A frozen copy of the *initial* policy, on this device: reloaded from ``model_name_or_path``; for a policy
        with LoRA adapters, the base under them (``adapters.BaseModelView``: no second copy of the weights)."""
        if has_adapters(self.policy):
            return BaseModelView(self.policy)
        model, _ = load_policy(self.hparams.model_name_or_path, self.hparams.dtype)
        return model.requires_grad_(False).eval().to(self.device)

    def forward_policy(self, batch: RolloutBatch, model: nn.Module | None = None, with_entropy: bool = False,
                       with_hidden: bool = False, extra_ids: Tensor | None = None) -> PolicyOutput:
        """``forward.policy_forward`` of ``batch`` under ``model`` (default: the policy) with this module's settings."""
        return policy_forward(self.policy if model is None else model, batch, self.logprob_chunk_size,
                              self.share_prompt_forward, self.share_prompt_min_tokens, with_entropy, with_hidden,
                              extra_ids, self.overwrite_logits)

    def score_sequences(self, contexts: list[list[int]], targets: list[list[int]],
                        target_masks: list[list[int]] | None = None, model: nn.Module | None = None,
                        temperature: float = 1.0, with_entropy: bool = False) -> tuple[PolicyOutput, Tensor]:
        """``(out, mask)``: log-probs, with gradient, of ``targets`` after ``contexts``
        (``forward.sequences_batch``)."""
        batch = sequences_batch(contexts, targets, target_masks, self.tokenizer.pad_token_id, temperature,
                                next(self.policy.parameters()).device)
        return self.forward_policy(batch, model, with_entropy=with_entropy), batch.loss_mask

    def candidate_logprobs(self, contexts: list[list[int]], candidates: Tensor | list[int],
                           model: nn.Module | None = None, temperature: float = 1.0) -> Tensor:
        """``[C, K]`` next-token log-probs of ``candidates`` after each context, with gradient
        (``forward.candidate_logprobs``: one forward row per context)."""
        return candidate_logprobs(self.policy if model is None else model, contexts, candidates,
                                  self.tokenizer.pad_token_id, temperature)

    def token_logprobs(self, batch: RolloutBatch, model: nn.Module | None = None,
                       with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """``(logprobs [N, T], entropy or None)`` of ``forward_policy`` (a shorthand)."""
        out = self.forward_policy(batch, model, with_entropy=with_entropy)
        return out.logprobs, out.entropy

    @staticmethod
    def proximal_logprobs(batch: RolloutBatch, out: PolicyOutput) -> Tensor:
        """``[n, T]`` the learner's log-probs before this batch's update (detached), for ``needs_proximal_logprobs``."""
        return out.logprobs.detach() if batch.proximal_logprobs is None else batch.proximal_logprobs
