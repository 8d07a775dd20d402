"""Update planning: which rows each optimiser step and micro-batch of ``RLModule.update`` forwards, as pure torch
functions of the batch and the settings (testable without a Trainer).

* ``minibatch_rows`` -- the rows of each minibatch of one pass (a seeded shuffle);
* ``micro_batches`` -- a minibatch's rows cut into micro-batches; with length bucketing, longest responses first,
  or a prompt's rows kept together when ``shared_prompt_forward`` then saves more than the padding costs;
* ``plan_update`` -- every optimiser step's micro-batches, leaving out inert rows, with every rank running the
  same number of forward/backward passes;
* the planner ``RLModule.update`` iterates, built from these, is ``update_plan.UpdatePlan``;
* ``trim_padding`` / ``micro_batch`` -- a micro-batch cut to the columns its rows use, with its advantages and
  aggregation weights;
* ``zero_advantage_rows`` -- the rows whose advantages are exactly 0 on every generated token.
"""

from __future__ import annotations

from dataclasses import fields, replace
from operator import attrgetter
from typing import Any, Callable

import torch
from torch import Tensor, nn

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.functional import aggregation_weights
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.generation import can_share_prompts, distinct_rows

#: ``(iteration, minibatch index, the minibatch's rows, its micro-batches)`` of one optimiser step
PlannedStep = tuple[int, int, Tensor, list[Tensor]]


#: the per-token ``RolloutBatch`` fields (second dimension ``T``) that ``trim_padding`` cuts with the response
#: (and every tensor of ``batch.record``, and ``obs_mask`` and ``index`` of ``batch.turns``)
_TOKEN_FIELDS = ("loss_mask", "sampler_logprobs", "ref_logprobs", "proximal_logprobs")


def trim_padding(batch: RolloutBatch) -> RolloutBatch:
    """``batch`` without the columns none of its rows uses: the left padding all its prompts share and the
    response columns after the last real token of every row (generated, EOS or observation).

    A causal model's outputs at the kept positions do not depend on the padding cut away (it is masked, and
    position ids count real tokens only), so log-probs, entropies and hidden states are the same, up to the
    rounding of reductions of another length. The known per-token fields are cut with the response; if some
    other per-row tensor (a field or ``extras``) has a second dimension of the response's or the row's width,
    it may be per-token too, and the batch is returned unchanged.
    """
    p = batch.prompt_length
    t = batch.input_ids.shape[1] - p
    attention = batch.attention_mask.bool()
    used = (attention[:, p:] | batch.loss_mask.bool()).any(dim=0)
    width = max(int(used.nonzero().max()) + 1 if bool(used.any()) else 0, 1)
    prompt_used = attention[:, :p].any(dim=0)
    left = min(int(prompt_used.nonzero().min()) if bool(prompt_used.any()) else p, max(p - 1, 0))
    if width >= t and left == 0:
        return batch
    known = {"input_ids", "attention_mask", *_TOKEN_FIELDS}
    others = [getattr(batch, f.name) for f in fields(batch) if f.name not in known] + list(batch.extras.values())
    if batch.turns is not None:  # turns.rewards [N, K] is checked as a field would be (count is 1-D)
        others.append(batch.turns.rewards)
    if any(isinstance(v, Tensor) and v.dim() >= 2 and v.shape[1] in (t, p + t) for v in others):
        return batch
    width = min(width, t)
    cut = {name: getattr(batch, name)[:, :width] for name in _TOKEN_FIELDS if getattr(batch, name) is not None}
    turns = None if batch.turns is None else replace(batch.turns, obs_mask=batch.turns.obs_mask[:, :width],
                                                     index=batch.turns.index[:, :width])
    return replace(batch, input_ids=batch.input_ids[:, left:p + width],
                   attention_mask=batch.attention_mask[:, left:p + width], prompt_length=p - left, **cut,
                   record=batch.record.map(lambda value: value[:, :width]), turns=turns)



def minibatch_rows(num_rows: int, num_minibatches: int, seed: int, step: int, iteration: int,
                   device: torch.device) -> list[Tensor]:
    """The rows of each of ``num_minibatches`` minibatches of pass ``iteration`` at ``step``: a shuffle seeded by
    ``(seed, step, iteration)``, the same on every rank and run; all rows in order for one minibatch."""
    if num_rows % num_minibatches:
        raise ValueError(f"num_minibatches={num_minibatches} does not divide the {num_rows} rows of a rollout batch "
                         f"(prompts_per_step x group_size per device)")
    if num_minibatches == 1:
        return [torch.arange(num_rows, device=device)]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + iteration)
    order = torch.randperm(num_rows, generator=gen).to(device)
    return list(order.chunk(num_minibatches))


def response_extent(batch: RolloutBatch) -> Tensor:
    """``[N]`` the columns of each row's response that are used (up to its last real or loss token)."""
    response = batch.attention_mask[:, batch.prompt_length:].bool() | batch.loss_mask.bool()
    columns = torch.arange(1, response.shape[1] + 1, device=response.device)
    return (response * columns).amax(dim=1) if response.shape[1] else columns.new_zeros(batch.num_rows)


def prompt_blocks(batch: RolloutBatch, model: nn.Module) -> Tensor | None:
    """``[N]`` the index of each row's distinct prompt (all but the last column, ids and mask) when
    ``shared_prompt_forward`` can apply to ``model`` and some rows share one; else ``None``."""
    p = batch.prompt_length
    if p < 2 or not can_share_prompts(model):
        return None
    shared = distinct_rows(torch.cat([batch.input_ids[:, :p - 1], batch.attention_mask[:, :p - 1]], dim=1))
    return None if shared is None else shared[1]


def forward_positions(extent: Tensor, prompt: Tensor, blocks: Tensor,
                      share_min_tokens: int) -> Callable[[list[Tensor]], int]:
    """``micro-batches -> token positions forwarded``: per micro-batch (cut by ``trim_padding``) its rows x (the
    longest prompt + the longest response), less what ``shared_prompt_forward`` saves where it applies."""
    extent_, prompt_, blocks_ = extent.tolist(), prompt.tolist(), blocks.tolist()

    def cost(micros: list[Tensor]) -> int:
        total = 0
        for micro in micros:
            rows = micro.tolist()
            p = max(max(prompt_[r] for r in rows), 1)
            total += len(rows) * (p + max(max(extent_[r] for r in rows), 1))
            saved = (len(rows) - len({blocks_[r] for r in rows})) * (p - 1)
            total -= saved if saved >= share_min_tokens else 0
        return total
    return cost


def micro_batches(rows: Tensor, extent: Tensor, size: int | None, bucketing: bool, prompt: Tensor | None = None,
                  blocks: Tensor | None = None, share_min_tokens: int = 1) -> list[Tensor]:
    """``rows`` cut into micro-batches of ``size`` (``None``: one); with ``bucketing``, longest responses first (a
    stable sort, so rows of equal length keep their order), so each micro-batch holds rows of similar length.

    ``blocks`` (``[N]``, when prompts are shared) numbers the rows' distinct prompts: then the order that keeps each
    prompt's rows together (prompts by their longest response, longest first) is taken instead when it costs fewer
    token positions (``forward_positions``: what sharing saves against the padding it adds).
    """
    if rows.numel() == 0:
        return []
    size = size or rows.numel()
    if not bucketing or size >= rows.numel():
        return list(rows.split(size))
    by_length = rows[torch.sort(extent[rows], descending=True, stable=True).indices]
    plan = list(by_length.split(size))
    if blocks is None or prompt is None or size == 1:
        return plan
    block = blocks[by_length]
    longest = torch.zeros(int(blocks.max()) + 1, dtype=extent.dtype, device=extent.device)
    longest = longest.scatter_reduce(0, block, extent[by_length], "amax")
    grouped = by_length[torch.sort(block, stable=True).indices]  # a prompt's rows together, longest first
    grouped = grouped[torch.sort(longest[blocks[grouped]], descending=True, stable=True).indices]
    other = list(grouped.split(size))
    cost = forward_positions(extent, prompt, blocks, share_min_tokens)
    return other if cost(other) < cost(plan) else plan


def plan_update(
    batch: RolloutBatch, skipped: Tensor | None, num_iterations: int, num_minibatches: int,
    micro_batch_size: int | None, bucketing: bool, blocks: Tensor | None, seed: int, step: int,
    reduce_max: Callable[[Tensor], Tensor], share_min_tokens: int, device: torch.device,
) -> list[PlannedStep]:
    """``(iteration, minibatch index, rows, micro-batches)`` of every optimiser step of an update.

    Skipped rows are left out before the minibatch's rows are cut into micro-batches. Every rank then runs the
    same number of forward/backward passes per optimiser step (each backward is a collective under DDP/FSDP),
    at least one: the most micro-batches any rank has (``reduce_max``, one all-reduce, only when rows are
    skipped), a rank with fewer making up the difference with one-row micro-batches of its shortest skipped rows,
    whose contribution is exactly zero. So an all-skipped step still back-propagates one row (a zero gradient for
    every parameter the loss reaches, as without skipping) and steps the optimiser.
    """
    extent = response_extent(batch)
    prompt = batch.attention_mask[:, :batch.prompt_length].sum(dim=1)
    steps: list[PlannedStep] = []
    for iteration in range(num_iterations):
        for index, rows in enumerate(minibatch_rows(batch.num_rows, num_minibatches, seed, step, iteration, device)):
            live = rows if skipped is None else rows[~skipped.to(rows.device)[rows]]
            on = rows.device
            steps.append((iteration, index, rows, micro_batches(
                live, extent.to(on), micro_batch_size, bucketing, prompt.to(on),
                None if blocks is None else blocks.to(on), share_min_tokens)))
    if skipped is None:
        return steps
    need = reduce_max(torch.tensor([len(micros) for *_, micros in steps], device=device))
    plan = []
    for (iteration, index, rows, micros), count in zip(steps, need.clamp(min=1).tolist()):
        if len(micros) < count:  # some rows of this minibatch were skipped: fill with them, shortest first
            idle = rows[skipped.to(rows.device)[rows]]
            idle = idle[torch.sort(extent.to(rows.device)[idle], stable=True).indices]
            micros = micros + [idle[j % idle.numel()].reshape(1) for j in range(count - len(micros))]
        plan.append((iteration, index, rows, micros))
    return plan


def unforwarded(rows: Tensor, micros: list[Tensor], num_rows: int) -> Tensor:
    """``[num_rows]`` bool: the ``rows`` of an optimiser step that none of its ``micros`` forwards."""
    idle = torch.zeros(num_rows, dtype=torch.bool, device=rows.device)
    idle[rows] = True
    for micro in micros:
        idle[micro] = False
    return idle


def micro_batch(batch: RolloutBatch, rows: Tensor, advantages: Advantages, weights: Tensor,
                trim: bool) -> tuple[RolloutBatch, Advantages, Tensor]:
    """The sub-batch of ``rows`` with its advantages and aggregation weights; with ``trim``, cut to the columns its
    rows use (``trim_padding``)."""
    mb, adv, w = batch.select(rows), advantages.select(rows), weights[rows]
    if trim:
        mb = trim_padding(mb)
        width = mb.loss_mask.shape[1]
        w = w[:, :width]
        adv = adv.cut(width)
    return mb, adv, w


def zero_advantage_rows(batch: RolloutBatch, advantages: Tensor) -> Tensor:
    """``[N]`` bool: the rows whose ``advantages`` (``[N, 1]`` or ``[N, T]``) are exactly 0 on every ``loss_mask``
    token (a row with no generated token included)."""
    mask = batch.loss_mask.bool()
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
    return ((adv.expand(mask.shape) == 0) | ~mask).all(dim=1)


def check_rollout_settings(module: Any, datamodule: Any, world_size: int, stage: str) -> None:
    """Refuse a data module whose rollout batch the module cannot split (``num_minibatches`` must divide the rows
    per device) or whose groups are smaller than the method's ``min_group_size``, naming the config fields."""
    name = type(module).__name__
    per_step, group_size = getattr(datamodule, "prompts_per_step", None), getattr(datamodule, "group_size", None)
    if per_step is not None and group_size is not None and stage == "fit":
        rows = per_step // max(world_size, 1) * group_size
        if rows % module.num_minibatches:
            raise ValueError(f"{name}: num_minibatches={module.num_minibatches} does not divide the {rows} rows of a "
                             f"rollout batch per device (data.init_args.prompts_per_step={per_step} / {world_size} "
                             f"device(s) x data.init_args.group_size={group_size})")
    if group_size is not None and group_size < module.min_group_size:
        raise ValueError(f"{name} needs data.init_args.group_size >= {module.min_group_size} (its baseline compares "
                         f"the responses to one prompt), got {group_size}")


def skipped_rows(module: Any, batch: RolloutBatch, adv: Advantages, terms: list[Any]) -> Tensor | None:
    """``[N]`` bool, the rows an update does not forward: ``module.inert_rows``, when every loss term promises to
    be zero (``contributes(module)`` is ``False``; a term without it counts as contributing); ``None`` when skipping
    cannot apply (the same answer on every rank: it depends on the configuration only)."""
    if any(t.contributes(module) for t in terms):
        return None
    rows = module.inert_rows(batch, adv)
    if rows is not None and tuple(rows.shape) != (batch.num_rows,):
        raise ValueError(f"{type(module).__name__}.inert_rows returned shape {tuple(rows.shape)}, expected "
                         f"({batch.num_rows},)")
    return None if rows is None else rows.to(device=batch.loss_mask.device, dtype=torch.bool)


def rollout_weights(batch: RolloutBatch, mode: Any, ranks: Any, norm_length: float | None = None) -> Tensor:
    """Aggregation weights ``[N, T]`` (``functional.aggregation_weights``, ``norm_length`` its constant ``L``) of
    the whole rollout batch: under data parallelism the sequence/token counts are summed over ``ranks`` and the
    weights scaled by ``W`` (DDP averages gradients), so the result equals one process holding every rank's rows."""
    if ranks.world_size == 1:
        return aggregation_weights(batch.loss_mask, mode, norm_length=norm_length)
    counts = ranks.sum(torch.tensor([float(batch.num_rows), float(batch.loss_mask.sum())],
                                    device=batch.loss_mask.device))
    return aggregation_weights(batch.loss_mask, mode, num_sequences=int(counts[0]),
                               num_tokens=float(counts[1]), norm_length=norm_length) * ranks.world_size


def require_data_setting(module: Any, datamodule: Any, setting: str, what: str, minimum: int = 1) -> None:
    """Refuse a data module whose ``setting`` (an int, by its dotted path: ``record.topk``, ``group_size``) is below
    ``minimum``, naming the config field and what the method reads from it (a data module of another class,
    without the setting, is not checked)."""
    try:
        value = attrgetter(setting)(datamodule)
    except AttributeError:
        value = None
    if value is not None and value < minimum:
        raise ValueError(f"{type(module).__name__} needs data.init_args.{setting} >= {minimum} ({what}); "
                         f"it is {value}")
