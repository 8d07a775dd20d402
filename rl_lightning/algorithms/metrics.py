"""The metrics of one update, their kind stated where their value is made.

A loss (``policy_objective``, ``policy_loss``, ``extra_losses``, the ``LossTerm`` callbacks) returns its metrics
as a dict of ``train/...`` names to values. How ``update`` combines a name over micro-batches, optimiser steps and
ranks depends on what the value is, so the value says it:

* ``TokenMean(x)``: a mean over the micro-batch's ``loss_mask`` tokens (``train/clip_fraction``, ...); logged as
  the mean over every token of the step's updates on every rank -- kept as ``[sum, token count]`` pairs, summed
  over ranks once at the end (``UpdateMetrics.finish``), not as a mean of per-micro-batch or per-rank means;
* ``Summed(x)``: a micro-batch's share of its optimiser step's loss (computed with the step's aggregation
  weights: ``train/policy_loss``, ``train/value_loss``, ...); summed over the step's micro-batches, so it does not
  depend on ``micro_batch_size``, then one entry per optimiser step. ``train/loss`` always is one;
* a plain tensor: one entry per micro-batch.

``training_step`` averages each list ``UpdateMetrics.finish`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenMean:
    """A metric that is a mean over the micro-batch's ``loss_mask`` tokens (see the module docstring)."""

    value: Tensor


@dataclass(frozen=True)
class Summed:
    """A metric that is the micro-batch's share of its optimiser step's total (see the module docstring)."""

    value: Tensor


#: what a loss reports per metric name
MetricValue = Union[Tensor, TokenMean, Summed]
#: a loss's metrics, by ``train/...`` name
Metrics = dict[str, MetricValue]


def plain(value: MetricValue) -> Tensor:
    """The tensor of a metric value, whatever its kind."""
    return value.value if isinstance(value, (TokenMean, Summed)) else value


class UpdateMetrics:
    """Collects the metrics of one update (see the module docstring)."""

    def __init__(self) -> None:
        self.stats: dict[str, list[Tensor]] = {}
        self._token_sums: dict[str, list[Tensor]] = {}  # name -> [sum over its tokens, token count]
        self._step_sums: dict[str, Tensor] = {}  # summed metrics of the running optimiser step

    def add(self, key: str, value: Tensor) -> None:
        """One plain entry (averaged with the others of ``key`` by ``training_step``)."""
        self.stats.setdefault(key, []).append(value.detach().float())

    def add_tokens(self, key: str, total: Tensor, tokens: Tensor) -> None:
        """Add ``total`` (a sum over ``tokens`` tokens) to the token mean ``key``."""
        pair = self._token_sums.setdefault(key, [tokens.new_zeros(()), tokens.new_zeros(())])
        pair[0], pair[1] = pair[0] + total.detach().float(), pair[1] + tokens

    def add_sampler_gap(self, batch: Any, out: Any) -> None:
        """``train/sampler_logp_diff`` (``|log π_θ - log μ|``) and ``train/entropy``, token means of a micro-batch
        forwarded before any update: the learner against the sampler that drew the tokens."""
        tokens = batch.loss_mask.sum().float()
        diff = (out.logprobs.detach() - batch.sampler_logprobs).abs() * batch.loss_mask
        self.add_tokens("train/sampler_logp_diff", diff.sum(), tokens)
        self.add_tokens("train/entropy", out.entropy.detach().sum(), tokens)

    def add_loss(self, loss: Tensor, metrics: dict[str, MetricValue], tokens: Tensor) -> None:
        """A micro-batch's loss and its metrics, each kind where it belongs (``tokens``: its ``loss_mask`` sum)."""
        self.add_summed({"train/loss": loss})
        for key, value in metrics.items():
            if isinstance(value, Summed):
                self.add_summed({key: value.value})
            elif isinstance(value, TokenMean):
                self.add_tokens(key, value.value.detach().float() * tokens, tokens)
            else:
                self.add(key, value)

    def add_summed(self, metrics: dict[str, Tensor]) -> None:
        """Add to the running optimiser step's summed metrics."""
        for key, value in metrics.items():
            self._step_sums[key] = self._step_sums.get(key, 0.0) + value.detach().float()

    def end_optimizer_step(self) -> None:
        """Close the running optimiser step: its summed metrics become one entry each."""
        for key, value in self._step_sums.items():
            self.add(key, value)
        self._step_sums = {}

    def finish(self, reduce_sum: Callable[[Tensor], Tensor] | None = None) -> dict[str, list[Tensor]]:
        """Every metric, the token means over every rank's tokens (``reduce_sum``: the all-reduce under data
        parallelism, ``None`` in one process). Which token means exist depends on the configuration only, so every
        rank reduces the same names in the same order."""
        names = sorted(self._token_sums)
        if names:
            sums = torch.stack([x for key in names for x in self._token_sums[key]])
            if reduce_sum is not None:
                sums = reduce_sum(sums)
            for key, (total, count) in zip(names, sums.view(-1, 2)):
                self.stats[key] = [total / count.clamp(min=1.0)]
        return self.stats


def clip_metrics(stats: Any) -> dict[str, MetricValue]:
    """The ``train/...`` token means of a clipped surrogate's ``functional.PolicyLossStats`` (PPO, GRPO, BPCO's
    divergence clip)."""
    return {
        "train/clip_fraction": TokenMean(stats.clip_fraction),
        "train/clip_fraction_low": TokenMean(stats.clip_fraction_low),
        "train/clip_fraction_high": TokenMean(stats.clip_fraction_high),
        "train/ratio_mean": TokenMean(stats.ratio_mean),
        "train/approx_kl": TokenMean(stats.approx_kl),
    }


def learning_rates(optimizers: list[Any]) -> dict[str, Tensor]:
    """The learning rate of every optimiser parameter group, now: ``train/lr`` for the first group of the first
    optimiser (the policy), ``train/lr_<name>`` for each other group, ``name`` being the group's ``"name"`` entry if
    it has one (PPO: ``critic``), else its index over all the optimisers' groups."""
    rates: dict[str, Tensor] = {}
    groups = [group for optimizer in optimizers for group in optimizer.param_groups]
    for index, group in enumerate(groups):
        key = "train/lr" if index == 0 else f"train/lr_{group.get('name', index)}"
        if key in rates:  # two groups of the same name
            key = f"{key}_{index}"
        rates[key] = torch.tensor(float(group["lr"]))
    return rates


def rollout_metrics(batch: Any) -> dict[str, Tensor]:
    """The fixed rollout metrics (docs/metrics.md: reward, spread, lengths, truncation) of a ``RolloutBatch``; for
    multi-turn episodes also ``train/num_turns`` and ``train/env_errors`` (the latter also for a single-turn batch in
    which an environment failed an episode); for a reward with named parts (``WeightedRewards``) each part's mean,
    ``train/reward/<name>``."""
    rewards = batch.rewards.float()
    groups = rewards.view(-1, batch.group_size)
    episodes = {} if batch.turns is None else {"train/num_turns": batch.turns.count.float().mean()}
    if batch.turns is not None or batch.env_errors:
        episodes["train/env_errors"] = torch.tensor(float(batch.env_errors))
    parts = {f"train/{key}": value.float().nanmean() for key, value in batch.extras.items()
             if key.startswith("reward/")}
    return {**episodes, **parts,
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(unbiased=False),
            # max == min, not std == 0: the std of a constant group of fractional rewards need not be exactly 0
            "train/zero_std_fraction": (groups.amax(dim=1) == groups.amin(dim=1)).float().mean(),
            "train/response_length": batch.response_lengths.float().mean(),
            "train/truncation_rate": batch.truncated.float().mean(),
            }


def step_metrics(stats: dict[str, list[Tensor]], batch: Any, update_time: float) -> dict[str, Tensor]:
    """One value per name for the step's log: the mean of each of the update's lists, the rollout metrics and the
    ``perf/...`` timings of the rollout, its reward and its update (``perf/step_time`` and ``perf/tokens_per_sec``
    come after the step's callbacks: ``step_log.StepLog``)."""
    metrics = {key: torch.stack([v.detach().float().reshape(()) for v in values]).mean()
               for key, values in stats.items()}
    return {**metrics, "perf/rollout_time": torch.tensor(batch.rollout_time),
            "perf/reward_time": torch.tensor(batch.reward_time), "perf/update_time": torch.tensor(update_time)}


def log_step(module: Any, metrics: dict[str, Tensor], step: int, batch_size: int, bar: tuple[str, ...] = ()) -> None:
    """Average ``metrics`` over ranks (one all-reduce) and write them at ``step``, the rollout's index.

    ``module.log_dict`` feeds the progress bar and the callbacks (``reward``: the bar's, and the names in ``bar``);
    the loggers get the values at ``step`` explicitly, the x-axis of ``val/reward``. Lightning's own logging step
    (``logger=True``) is not used: after a resume from a checkpoint written at the end of fit it runs one ahead
    (measured: a resumed curve logged at 0, 1, 3), and setting it needs Lightning's private loop state.
    """
    names = list(metrics)
    values = module.ranks.mean(torch.stack([metrics[k].detach().float().to(module.device).reshape(()) for k in names]))
    reduced = dict(zip(names, values))
    for shown in (False, True):
        part = {k: v for k, v in reduced.items() if (k in bar) == shown}
        if part:
            module.log_dict(part, on_step=True, on_epoch=False, logger=False, batch_size=batch_size, prog_bar=shown)
    if "train/reward" in reduced:
        module.log("reward", reduced["train/reward"], prog_bar=True, logger=False, batch_size=batch_size)
    if module.trainer.is_global_zero:
        scalars = {k: float(v) for k, v in reduced.items()}
        for logger in module.loggers:
            logger.log_metrics(scalars, step=step)
