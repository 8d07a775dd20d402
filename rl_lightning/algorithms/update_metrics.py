"""``UpdateMetrics``: the bookkeeping of one ``RLModule.update``'s metrics, kept apart from the update loop.

Three kinds of metric leave a loss (``policy_loss`` and the ``LossTerm`` callbacks), as the method declares them
(``RLModule.token_mean_metrics`` / ``summed_metrics``):

* **token means** (``train/clip_fraction``, ...): means over a micro-batch's ``loss_mask`` tokens; logged as the
  mean over every token of the step's updates on every rank -- kept as ``[sum, token count]`` pairs, summed over
  ranks once at the end (``finish``), not as a mean of per-micro-batch or per-rank means;
* **summed** (``train/loss``, ``train/policy_loss``, ...): a micro-batch's share of its optimiser step's loss
  (computed with the step's aggregation weights); summed over the step's micro-batches, so they do not depend on
  ``micro_batch_size``, then one entry per optimiser step;
* **everything else**: one entry per micro-batch.

``training_step`` averages each list it gets back.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


class UpdateMetrics:
    """Collects the metrics of one update (see the module docstring).

    Args:
        token_mean: the names logged as token means over the whole update.
        summed: the names summed over each optimiser step's micro-batches (``train/loss`` always is one).
    """

    def __init__(self, token_mean: frozenset[str], summed: frozenset[str]) -> None:
        self.token_mean = token_mean
        self.summed = summed | {"train/loss"}
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

    def add_loss(self, loss: Tensor, metrics: dict[str, Tensor], tokens: Tensor) -> None:
        """A micro-batch's loss and its metrics, each kind where it belongs (``tokens``: its ``loss_mask`` sum)."""
        for key, value in {"train/loss": loss, **metrics}.items():
            value = value.detach().float()
            if key in self.summed:
                self._step_sums[key] = self._step_sums.get(key, 0.0) + value
            elif key in self.token_mean:
                self.add_tokens(key, value * tokens, tokens)
            else:
                self.add(key, value)

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
