"""``RLModule``: what every method shares. A method subclasses it and overrides a few narrow hooks.

The step template (``training_step``), for one ``RolloutBatch`` produced by the data module:

1. ``advantages = compute_advantages(batch)``            -- hook (``[N]`` or ``[N, T]``, detached)
2. ``weights = loss_weights(batch)``                     -- aggregation normaliser, once per rollout batch
3. ``update(batch, advantages, weights)``                -- hook with a default: for ``num_iterations`` (μ)
   passes, for each of ``num_minibatches`` minibatches (one optimiser step each), for each micro-batch of
   ``micro_batch_size`` rows (gradient accumulation): ``out = forward_policy(mb)``;
   ``loss = policy_loss(mb, out, advantages, weights)`` -- hook; ``+`` every loss term contributed by
   callbacks (``LossTerm`` protocol); backward; then clip, refuse non-finite values, step.
4. log the fixed metrics at the rollout's step.

Because the weights are computed on the whole batch (and summed over ranks under data parallelism), the
gradient of one optimiser step does not depend on how its rows are split into micro-batches or devices.

Two savings in ``update`` that leave the update exactly the same (up to the fp32 rounding of a sum taken in
another order):

* **inert rows** (``skip_inert_rows``): rows whose every loss term is exactly zero with zero gradient
  (``inert_rows``: by default the zero-advantage rows of a method that declares
  ``zero_advantage_rows_are_inert``, when no ``LossTerm`` contributes) are not forwarded at all; their
  aggregation weights stay in the normaliser, which was computed before on the whole batch;
* **length bucketing** (``length_bucketing``): each minibatch's rows are ordered by response length before they
  are cut into micro-batches of ``micro_batch_size``, and every micro-batch is cut to the columns its rows use
  (``trim_padding``).

A third one, in ``forward_policy``: the **shared prompt forward** (``share_prompt_forward``). Rows of a
micro-batch whose prompts are identical (the ``G`` rows of a group, found from the token ids, so whatever
split the micro-batch is) run their prompt once, with gradient: its keys/values are repeated to each row and
the responses are scored on them (``shared_prompt_forward``), the same log-probs, entropies, hidden states and
gradient as one forward of every row.

``trainer.global_step`` counts rollout batches: only the last optimiser step of a batch goes through
Lightning's step counter, inner ones call the wrapped torch optimiser directly.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol, runtime_checkable

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torchmetrics import MeanMetric

from rl_lightning.algorithms.update_metrics import UpdateMetrics
from rl_lightning.functional import (
    AggregationMode, PolicyLossStats, aggregation_weights, sampling_logprobs, sampling_logprobs_at,
)
from rl_lightning.models.policy import DType, load_policy
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.generation import (
    _cache_argument, _returned_cache, can_share_prompts, distinct_rows, expandable_cache, position_ids_from_mask,
    repeat_cache_rows, unshareable,
)


def clip_metrics(stats: PolicyLossStats) -> dict[str, Tensor]:
    """The ``train/...`` metrics of a clipped surrogate's ``PolicyLossStats`` (PPO, GRPO, BPCO's divergence clip)."""
    return {
        "train/clip_fraction": stats.clip_fraction, "train/clip_fraction_low": stats.clip_fraction_low,
        "train/clip_fraction_high": stats.clip_fraction_high, "train/ratio_mean": stats.ratio_mean,
        "train/approx_kl": stats.approx_kl,
    }


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


#: the per-token ``RolloutBatch`` fields (second dimension ``T``) that ``trim_padding`` cuts with the response
_TOKEN_FIELDS = ("loss_mask", "sampler_logprobs", "obs_mask", "ref_logprobs", "proximal_logprobs",
                 "values", "returns", "turn_index",
                 "topk_ids", "topk_logprobs", "aux_ids")


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
    if any(isinstance(v, Tensor) and v.dim() >= 2 and v.shape[1] in (t, p + t) for v in others):
        return batch
    width = min(width, t)
    cut = {name: getattr(batch, name)[:, :width] for name in _TOKEN_FIELDS if getattr(batch, name) is not None}
    return replace(batch, input_ids=batch.input_ids[:, left:p + width],
                   attention_mask=batch.attention_mask[:, left:p + width], prompt_length=p - left, **cut)


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
    cache = _returned_cache(prefix)
    if not expandable_cache(cache):
        unshareable(model, cache)
        return None
    del prefix
    repeat_cache_rows(cache, inverse)  # [U, ...] -> [n, ...], with a backward that sums in a fixed order
    end = input_ids.shape[1] - 1  # the last token is never an input: it predicts nothing
    out = model(input_ids=input_ids[:, p - 1:end], attention_mask=attention_mask[:, :end],
                position_ids=positions[:, p - 1:end], use_cache=True, logits_to_keep=0,
                output_hidden_states=with_hidden, **{_cache_argument(model): cache})
    return out.logits, out.hidden_states[-1] if with_hidden else None


@runtime_checkable
class LossTerm(Protocol):
    """What a callback implements to add a term to every policy loss (e.g. ``KLRegularizer``).

    ``loss_term`` is called once per micro-batch with the learner's ``logprobs`` ``[n, T]`` (carrying the
    gradient) and the aggregation ``weights`` ``[n, T]`` of those rows; it returns the term to *add* to the loss
    and a dict of detached scalar metrics (logged as their mean over the step's updates).

    Optionally the callback also has ``contributes(module) -> bool``: ``False`` promises that ``loss_term`` is
    exactly zero with zero gradient for every row this update (``KLRegularizer`` with ``beta = 0``), so rows the
    method finds inert may be skipped (``RLModule.inert_rows``). A loss term without it counts as contributing
    to every row, which switches the skipping off. The answer must be the same on every rank.
    """

    def loss_term(
        self, module: RLModule, batch: RolloutBatch, logprobs: Tensor, weights: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


@runtime_checkable
class HeldoutObserver(Protocol):
    """What a callback implements to see each held-out (greedy) evaluation (e.g. ``RolloutSamples``).

    ``on_heldout_evaluated`` is called on every rank once per evaluation -- the step-0 one ``on_train_start``
    runs, every validation of Lightning's loop (not the sanity check) and the last-step one ``on_train_end``
    runs -- with this rank's first held-out ``RolloutBatch`` (one greedy response per prompt, rewards filled in),
    ``step`` (``trainer.global_step``, the updates done before the evaluation) and ``reward``, the mean held-out
    reward over all ranks (the ``val/reward`` logged at ``step``).
    """

    def on_heldout_evaluated(
        self, trainer: Any, module: RLModule, batch: RolloutBatch, step: int, reward: float
    ) -> None: ...


class NonFiniteLossError(FloatingPointError):
    """A loss or gradient was NaN/inf; raised before the optimiser step, so the weights stay finite."""


class RLModule(LightningModule):
    """Base of every algorithm: policy, optimiser, per-token log-probs, the update loop and its logging.

    Args:
        model_name_or_path: ``embedded:arithmetic`` (the packaged warm start), ``embedded:random``, or a local
            Hugging Face checkpoint directory.
        dtype: parameter dtype of the policy (``bfloat16`` for real models on GPU).
        optimizer: optimiser factory, e.g. ``{class_path: torch.optim.AdamW, init_args: {lr: 1e-4}}``.
        lr_scheduler: optional scheduler factory, stepped once per rollout batch.
        num_iterations: μ, passes over each rollout batch (π_old stays the sampler's log-probs).
        num_minibatches: optimiser steps per pass; must divide the number of rows.
        micro_batch_size: rows per forward/backward (gradient accumulation); ``None`` = the whole minibatch.
        loss_aggregation: how per-token losses are combined (see ``functional.aggregation_weights``).
        max_grad_norm: gradient-norm clip (``None`` disables clipping; the norm is still logged).
        logprob_chunk_size: token positions per chunk when turning logits into log-probs and entropy (bounds
            the temporaries to [chunk, V]; see functional.sampling_logprobs).
        seed: seeds minibatch shuffling.
        skip_inert_rows: do not forward rows whose loss is exactly zero with zero gradient (``inert_rows``);
            the update is the same (``train/skipped_rows`` logs the fraction skipped). ``False`` forwards every row.
            Both switches act in the default ``update`` (TRPO's own update forwards every row, unbucketed).
        length_bucketing: order each minibatch's rows by response length before cutting it into micro-batches
            (when ``micro_batch_size`` splits it), and cut every micro-batch to the columns its rows use (the
            shared left padding of the prompts, the right padding after the longest response): less padding,
            the same gradient. ``False`` keeps the minibatch's row order and the batch's full width.
        share_prompt_forward: in every forward of ``forward_policy``, run a prompt that several rows share (the
            ``G`` rows of a group) once, with gradient, and score each row's response on its keys/values
            (``shared_prompt_forward``): the same log-probs and gradient. It applies to the rows of a forward that
            have identical prompt ids (checked on the data; episodes whose first observation differs do not
            share) and switches itself off where it cannot be exact (dropout in training mode, gradient
            checkpointing, a cache other than a plain ``DynamicCache``). ``False`` forwards every row whole.
    """

    def __init__(
        self,
        model_name_or_path: str = "embedded:arithmetic",
        dtype: DType = "float32",
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        num_iterations: int = 1,
        num_minibatches: int = 1,
        micro_batch_size: int | None = None,
        loss_aggregation: AggregationMode = "seq_mean_token_mean",
        max_grad_norm: float | None = 1.0,
        logprob_chunk_size: int = 256,
        seed: int = 0,
        skip_inert_rows: bool = True,
        length_bucketing: bool = True,
        share_prompt_forward: bool = True,
    ) -> None:
        super().__init__()
        for name, flag in (("skip_inert_rows", skip_inert_rows), ("length_bucketing", length_bucketing),
                           ("share_prompt_forward", share_prompt_forward)):
            if not isinstance(flag, bool):
                raise ValueError(f"{type(self).__name__}: {name} must be true or false, got {flag!r}")
        for name, value in (("num_iterations", num_iterations), ("num_minibatches", num_minibatches),
                            ("logprob_chunk_size", logprob_chunk_size)):
            if value < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be >= 1, got {value}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"{type(self).__name__}: micro_batch_size must be >= 1 or null, got {micro_batch_size}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"{type(self).__name__}: max_grad_norm must be > 0 or null, got {max_grad_norm}")
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.num_iterations = num_iterations
        self.num_minibatches = num_minibatches
        self.micro_batch_size = micro_batch_size
        self.loss_aggregation = loss_aggregation
        self.max_grad_norm = max_grad_norm
        self.logprob_chunk_size = logprob_chunk_size
        self.seed = seed
        self.skip_inert_rows = skip_inert_rows
        self.length_bucketing = length_bucketing
        self.share_prompt_forward = share_prompt_forward
        self.policy, self.tokenizer = load_policy(model_name_or_path, dtype)
        self.policy.train()  # from_pretrained returns eval mode; Lightning toggles modes from here on
        self.automatic_optimization = False
        self.val_reward = MeanMetric()
        self._val_step = -1  # the step of the last val/reward logged (-1: none yet); kept in checkpoints
        self.val_history: list[tuple[int, float]] = []  # (step, val/reward) of every evaluation; in checkpoints

    # ================================================================== hooks for methods
    @abstractmethod
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        """Advantages for ``batch``: ``[N]`` (one per response) or ``[N, T]`` (per token). Must be detached."""

    @abstractmethod
    def policy_loss(
        self, batch: RolloutBatch, out: PolicyOutput, advantages: Tensor, weights: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of the rows of ``batch`` (to minimise) and detached metrics (named ``train/...``).

        ``out`` is ``forward_policy`` of those rows; ``advantages`` are the rows' slice, shaped ``[n, 1]`` or
        ``[n, T]``; ``weights`` ``[n, T]`` are the aggregation weights to use with ``functional.aggregate``.
        """

    #: smallest ``data.group_size`` the method's advantages make sense for (2 for group baselines)
    min_group_size: int = 1
    #: ask ``forward_policy`` for a differentiable entropy on every update (entropy bonuses)
    needs_entropy: bool = False
    #: ask ``forward_policy`` for the final hidden states (value heads on the policy backbone)
    needs_hidden: bool = False
    #: the loss uses the learner's log-probs before the update (``batch.proximal_logprobs``, a decoupled
    #: objective's proximal policy): ``update`` fills them in with one no-grad forward when it takes several
    #: optimiser steps; with one, they equal the detached log-probs of the forward itself and stay ``None``
    #: (``proximal_logprobs`` returns the right one either way)
    needs_proximal_logprobs: bool = False
    #: the method's ``policy_loss`` of a row whose advantages are exactly zero on all its ``loss_mask`` tokens is
    #: exactly zero with zero gradient (true of ``Σ w · A · f(ρ)`` losses: PG, REINFORCE, RLOO, GRPO, SPO,
    #: FlashREINFORCE; not with a value loss, an entropy bonus or any other term), so ``inert_rows`` may skip such
    #: rows. The declaration holds for the ``policy_loss`` of the class that makes it: a subclass that overrides
    #: ``policy_loss`` (CoPE adds a forecasting term) does not inherit it and must declare it again itself.
    #: A method that sets ``needs_entropy`` or ``needs_hidden`` never skips.
    zero_advantage_rows_are_inert: bool = False
    #: loss metrics that are means over the micro-batch's ``loss_mask`` tokens; ``update`` logs each as the mean
    #: over every token of the step's updates on every rank (weighted by token count), not as a mean of
    #: per-micro-batch (or per-rank) means. A subclass adds its own names with ``RLModule.token_mean_metrics | {...}``.
    token_mean_metrics: frozenset[str] = frozenset({
        "train/clip_fraction", "train/clip_fraction_low", "train/clip_fraction_high", "train/ratio_mean",
        "train/approx_kl", "train/value_clip_fraction", "train/logprob_mean", "train/advantage_mean", "train/kl",
    })
    #: loss metrics computed with the step's aggregation weights: a micro-batch's value is its share of the
    #: optimiser step's loss, so ``update`` logs their sum over each optimiser step's micro-batches (then the
    #: mean over optimiser steps) and they do not depend on ``micro_batch_size``. ``train/loss`` always is one.
    summed_metrics: frozenset[str] = frozenset({
        "train/policy_loss", "train/value_loss", "train/kl_loss", "train/entropy_bonus",
    })
    #: a forward shares its prompts (``share_prompt_forward``) only when that saves at least this many prompt
    #: positions: below, the second forward call costs more than it saves (on a 2-core CPU with the 1.1M embedded
    #: model the break-even is ~50-80 positions, e.g. one group of 8 with a 7-token prompt saves 42; a larger
    #: model breaks even sooner). Also what ``length_bucketing`` counts when it keeps a group's rows together.
    share_prompt_min_tokens: int = 64
    # per-instance state set by the hooks below (class defaults, so ``__init__`` stays the methods' own)
    _step_learning_rates: dict[str, Tensor] | None = None  # noted at on_train_batch_start for the step's log
    _heldout_batch: RolloutBatch | None = None  # the first batch of the running validation, for observers
    #: ``[N]`` bool set by ``update``: the rows of the last rollout batch that were forwarded (all of them unless
    #: inert rows were skipped), for a subclass's ``update`` that reports per-row metrics of every row
    forwarded_rows: Tensor | None = None

    def inert_rows(self, batch: RolloutBatch, advantages: Tensor) -> Tensor | None:
        """``[N]`` bool: the rows whose every loss term is exactly zero with zero gradient, or ``None`` when the
        method can never tell (then nothing is skipped and no collective is spent on it).

        ``update`` does not forward these rows (``skip_inert_rows``): their aggregation weights were already
        counted in the normaliser, so the gradient is the same. ``advantages`` are ``[N, 1]`` or ``[N, T]``.
        Default: if the method declares ``zero_advantage_rows_are_inert`` (and needs neither entropy nor hidden
        states), the rows whose advantages are exactly 0 on every ``loss_mask`` token (a row with no generated
        token included), else ``None``. Only called when no ``LossTerm`` contributes (see ``LossTerm``).
        Whether it returns ``None`` must depend on the configuration only (the same on every rank); the rows
        may differ per rank.
        """
        if not self._declares_zero_advantage_rows_inert():
            return None
        mask = batch.loss_mask.bool()
        adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
        return ((adv.expand(mask.shape) == 0) | ~mask).all(dim=1)

    def _declares_zero_advantage_rows_inert(self) -> bool:
        if not self.zero_advantage_rows_are_inert or self.needs_entropy or self.needs_hidden:
            return False
        if "zero_advantage_rows_are_inert" in vars(self):  # set on the instance: its owner's word
            return True
        mro = type(self).__mro__
        declared_by = next(k for k in mro if "zero_advantage_rows_are_inert" in vars(k))
        loss_from = next(k for k in mro if "policy_loss" in vars(k))
        return issubclass(declared_by, loss_from)  # declared for the policy_loss in use, not an ancestor's

    def check_datamodule(self, datamodule: Any) -> None:
        """Refuse data settings the method cannot use (called at setup). Default: accept everything."""

    def require_data_setting(self, datamodule: Any, setting: str, what: str, minimum: int = 1) -> None:
        """For ``check_datamodule``: refuse a data module whose ``setting`` (an int such as ``record_topk``) is
        below ``minimum``, naming the config field and what the method reads from it. A data module without the
        attribute (a custom one) is not checked."""
        value = getattr(datamodule, setting, None)
        if value is not None and value < minimum:
            raise ValueError(f"{type(self).__name__} needs data.init_args.{setting} >= {minimum} ({what}); "
                             f"it is {value}")

    def extra_logprob_ids(self, batch: RolloutBatch) -> Tensor | None:
        """``[n, T, J]`` token ids at which the update also needs the learner's log-probs, besides the sampled
        tokens (``PolicyOutput.extra_logprobs``, from the same forward and chunked pass), or ``None``.

        Score Centering asks for the sampler's recorded top-k ids (``batch.topk_ids``), StableReinforce for its
        auxiliary draws (``batch.aux_ids``). ``batch`` is the micro-batch being forwarded. Default: ``None``.
        """
        return None

    # ================================================================== shared machinery
    def configure_optimizers(self) -> Any:
        try:
            optimizer = self.optimizer_factory(self.parameter_groups())
        except (ValueError, TypeError) as err:  # e.g. torch's "Invalid learning rate: -0.0001"
            raise ValueError(f"model.init_args.optimizer: the optimiser refused its settings: {err}") from None
        if self.lr_scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.lr_scheduler_factory(optimizer)}

    def parameter_groups(self) -> list[dict[str, Any]]:
        """Optimiser parameter groups: the policy (settings from ``optimizer``); methods add e.g. a critic group."""
        return [{"params": list(self.policy.parameters())}]

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None:
            return
        per_step = getattr(datamodule, "prompts_per_step", None)
        group_size = getattr(datamodule, "group_size", None)
        if per_step is not None and group_size is not None and stage == "fit":
            rows = per_step // max(self.trainer.world_size, 1) * group_size
            if rows % self.num_minibatches:
                raise ValueError(
                    f"{type(self).__name__}: num_minibatches={self.num_minibatches} does not divide the {rows} rows "
                    f"of a rollout batch per device (data.init_args.prompts_per_step={per_step} / "
                    f"{self.trainer.world_size} device(s) x data.init_args.group_size={group_size})"
                )
        if group_size is not None and group_size < self.min_group_size:
            raise ValueError(
                f"{type(self).__name__} needs data.init_args.group_size >= {self.min_group_size} (its baseline "
                f"compares the responses to one prompt), got {group_size}"
            )
        self.check_datamodule(datamodule)

    def load_frozen_copy(self) -> nn.Module:
        """A fresh, frozen copy of the *initial* policy (reloaded from ``model_name_or_path``), on this device."""
        model, _ = load_policy(self.hparams.model_name_or_path, self.hparams.dtype)
        return model.requires_grad_(False).eval().to(self.device)

    def forward_policy(
        self, batch: RolloutBatch, model: nn.Module | None = None, with_entropy: bool = False,
        with_hidden: bool = False, extra_ids: Tensor | None = None,
    ) -> PolicyOutput:
        """Score the generated tokens of ``batch`` under ``model`` (default: the policy).

        Tokens are scored under the sampler's exact distribution (its temperature and top-p), so on-policy the
        log-probs equal ``batch.sampler_logprobs``. Only the ``T + 1`` positions that predict response tokens
        are projected to the vocabulary. With ``share_prompt_forward``, rows with identical prompts run them once
        (``shared_prompt_forward``; the same outputs and gradient). ``extra_ids`` ``[N, T, J]``: also the
        log-probs at those ids (``PolicyOutput.extra_logprobs``, ``functional.sampling_logprobs_at``).
        """
        model = self.policy if model is None else model
        width = batch.input_ids.shape[1] - batch.prompt_length  # T
        shared = shared_prompt_forward(model, batch.input_ids, batch.attention_mask, batch.prompt_length,
                                       with_hidden, self.share_prompt_min_tokens) if self.share_prompt_forward else None
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
                logits, batch.response_ids, batch.temperature, batch.top_p, self.logprob_chunk_size, with_entropy
            )
        else:
            logprobs, extra, entropy = sampling_logprobs_at(
                logits, batch.response_ids, extra_ids, batch.temperature, batch.top_p, self.logprob_chunk_size,
                with_entropy,
            )
            extra = torch.where(batch.loss_mask.bool().unsqueeze(-1), extra, torch.zeros_like(extra))
        mask = batch.loss_mask.to(logprobs.dtype)
        return PolicyOutput(logprobs * mask, None if entropy is None else entropy * mask, hidden, extra)

    def score_sequences(
        self, contexts: list[list[int]], targets: list[list[int]], target_masks: list[list[int]] | None = None,
        model: nn.Module | None = None, temperature: float = 1.0, with_entropy: bool = False,
    ) -> tuple[PolicyOutput, Tensor]:
        """Log-probs, with gradient, of arbitrary ``targets`` after ``contexts`` (token ids; a second forward
        a loss may need, e.g. CoPE's forecasting or a generative critic's value tokens).

        Returns ``(out, mask)``: ``out.logprobs`` ``[n, T]`` for the right-padded targets under ``model``
        (default: the policy) at ``temperature`` (full vocabulary), 0 where ``mask`` is 0; ``mask`` ``[n, T]``
        is 1 on target tokens (``target_masks``, default all of them) and 0 on padding.
        """
        if len(contexts) != len(targets) or not contexts:
            raise ValueError(f"score_sequences: {len(contexts)} contexts for {len(targets)} targets")
        device = next(self.policy.parameters()).device
        pad = self.tokenizer.pad_token_id
        width_p = max(len(c) for c in contexts)
        width_t = max(1, max(len(t) for t in targets))
        n = len(contexts)
        ids = torch.full((n, width_p + width_t), pad, dtype=torch.long)
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
        batch = RolloutBatch(
            input_ids=ids.to(device), attention_mask=attention.to(device), prompt_length=width_p,
            loss_mask=mask.to(device), sampler_logprobs=torch.zeros(n, width_t, device=device),
            rewards=torch.zeros(n, device=device), group_size=1, prompt_index=torch.zeros(n, dtype=torch.long,
            device=device), truncated=torch.zeros(n, dtype=torch.bool, device=device), temperature=temperature)
        return self.forward_policy(batch, model, with_entropy=with_entropy), batch.loss_mask

    @staticmethod
    def proximal_logprobs(batch: RolloutBatch, out: PolicyOutput) -> Tensor:
        """``[n, T]`` the learner's log-probs before this batch's update (detached), for ``needs_proximal_logprobs``:
        ``batch.proximal_logprobs`` when ``update`` computed them, else the forward's own (one optimiser step)."""
        return out.logprobs.detach() if batch.proximal_logprobs is None else batch.proximal_logprobs

    @torch.no_grad()
    def _fill_proximal_logprobs(self, batch: RolloutBatch) -> RolloutBatch:
        rows = torch.arange(batch.num_rows, device=batch.loss_mask.device)
        logprobs = torch.zeros_like(batch.sampler_logprobs)
        for micro in rows.split(self.micro_batch_size or batch.num_rows):
            mb = batch.select(micro)
            logprobs[micro] = self.forward_policy(mb).logprobs.float()
        return replace(batch, proximal_logprobs=logprobs)

    def token_logprobs(
        self, batch: RolloutBatch, model: nn.Module | None = None, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """``(logprobs [N, T], entropy or None)`` of ``forward_policy`` (a shorthand)."""
        out = self.forward_policy(batch, model, with_entropy=with_entropy)
        return out.logprobs, out.entropy

    def loss_weights(self, batch: RolloutBatch) -> Tensor:
        """Aggregation weights ``[N, T]`` for the whole rollout batch, with the normaliser summed over ranks.

        Under data parallelism gradients are averaged over ``W`` ranks, so local weights are scaled by ``W``
        and use the global sequence/token counts: the result equals one process holding the whole batch.
        """
        world = self.trainer.world_size if self._trainer is not None else 1
        if world == 1:
            return aggregation_weights(batch.loss_mask, self.loss_aggregation)
        counts = torch.tensor([float(batch.num_rows), float(batch.loss_mask.sum())], device=self.device)
        counts = self.trainer.strategy.reduce(counts, reduce_op="sum")
        weights = aggregation_weights(batch.loss_mask, self.loss_aggregation, num_sequences=int(counts[0]),
                                      num_tokens=float(counts[1]))
        return weights * world

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """``[obj of rank 0, obj of rank 1, ...]``: one picklable object from every rank (``[obj]`` in one process).

        For per-prompt state a method keeps identical on every rank (SPO's tracker): each rank gathers every
        rank's updates and applies them in rank order, so the state is the same everywhere and in checkpoints.
        Every rank must call it at the same point (it is a collective).
        """
        if self._trainer is None or self.trainer.world_size == 1 or not torch.distributed.is_initialized():
            return [obj]
        gathered: list[Any] = [None] * self.trainer.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    def _loss_terms(self) -> list[LossTerm]:
        return [cb for cb in self.trainer.callbacks if isinstance(cb, LossTerm)] if self._trainer else []

    def _minibatches(self, num_rows: int, iteration: int) -> list[Tensor]:
        if num_rows % self.num_minibatches:
            raise ValueError(
                f"{type(self).__name__}: num_minibatches={self.num_minibatches} does not divide the {num_rows} "
                f"rows of a rollout batch (prompts_per_step x group_size per device)"
            )
        if self.num_minibatches == 1:
            return [torch.arange(num_rows, device=self.device)]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.global_step * 1_009 + iteration)
        order = torch.randperm(num_rows, generator=gen).to(self.device)
        return list(order.chunk(self.num_minibatches))

    def _micro_batches(self, rows: Tensor, extent: Tensor, prompt: Tensor | None = None,
                       blocks: Tensor | None = None) -> list[Tensor]:
        """``rows`` cut into micro-batches; with ``length_bucketing``, longest responses first (a stable sort, so
        rows of equal length keep their order), so each micro-batch holds rows of similar length.

        ``blocks`` (``[N]``, with ``share_prompt_forward``) numbers the rows' distinct prompts: then the order that
        keeps each prompt's rows together (prompts by their longest response, longest first) is taken instead when
        it costs fewer token positions (``_forward_positions``: what sharing saves against the padding it adds).
        """
        if rows.numel() == 0:
            return []
        size = self.micro_batch_size or rows.numel()
        if not self.length_bucketing or size >= rows.numel():
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
        cost = self._forward_positions(extent, prompt, blocks)
        return other if cost(other) < cost(plan) else plan

    def _forward_positions(self, extent: Tensor, prompt: Tensor, blocks: Tensor):  # noqa: ANN202
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
                total -= saved if saved >= self.share_prompt_min_tokens else 0
            return total
        return cost

    def _prompt_blocks(self, batch: RolloutBatch) -> Tensor | None:
        """``[N]`` the index of each row's distinct prompt (all but the last column, ids and mask) when
        ``share_prompt_forward`` can apply and some rows share one; else ``None``."""
        p = batch.prompt_length
        if not self.share_prompt_forward or p < 2 or not can_share_prompts(self.policy):
            return None
        shared = distinct_rows(torch.cat([batch.input_ids[:, :p - 1], batch.attention_mask[:, :p - 1]], dim=1))
        return None if shared is None else shared[1]

    def _skipped_rows(self, batch: RolloutBatch, advantages: Tensor, terms: list[LossTerm]) -> Tensor | None:
        """``[N]`` bool, the rows ``update`` does not forward; ``None`` when skipping cannot apply (the same
        answer on every rank: it depends on the configuration only)."""
        if not self.skip_inert_rows:
            return None
        for term in terms:
            contributes = getattr(term, "contributes", None)
            if contributes is None or contributes(self):
                return None
        rows = self.inert_rows(batch, advantages)
        if rows is None:
            return None
        rows = rows.to(device=batch.loss_mask.device, dtype=torch.bool)
        if rows.shape != (batch.num_rows,):
            raise ValueError(f"{type(self).__name__}.inert_rows returned shape {tuple(rows.shape)}, expected "
                             f"({batch.num_rows},)")
        return rows

    def _update_plan(self, batch: RolloutBatch, skipped: Tensor | None) -> list[tuple[int, int, list[Tensor]]]:
        """``(iteration, minibatch index, micro-batches)`` of every optimiser step of ``update``.

        Skipped rows are left out before the minibatch's rows are cut into micro-batches. Every rank then runs the
        same number of forward/backward passes per optimiser step (each backward is a collective under DDP/FSDP),
        at least one: the most micro-batches any rank has (one ``max`` all-reduce per update), a rank with fewer
        making up the difference with one-row micro-batches of its shortest skipped rows, whose contribution is
        exactly zero. So an all-skipped step still back-propagates one row (a zero gradient for every parameter
        the loss reaches, as without skipping) and steps the optimiser.
        """
        response = batch.attention_mask[:, batch.prompt_length:].bool() | batch.loss_mask.bool()
        columns = torch.arange(1, response.shape[1] + 1, device=response.device)
        extent = (response * columns).amax(dim=1) if response.shape[1] else columns.new_zeros(batch.num_rows)
        prompt = batch.attention_mask[:, :batch.prompt_length].sum(dim=1)
        blocks = self._prompt_blocks(batch) if self.length_bucketing and self.micro_batch_size else None
        steps: list[tuple[int, int, Tensor, list[Tensor]]] = []
        for iteration in range(self.num_iterations):
            for index, rows in enumerate(self._minibatches(batch.num_rows, iteration)):
                live = rows if skipped is None else rows[~skipped.to(rows.device)[rows]]
                device = rows.device
                steps.append((iteration, index, rows, self._micro_batches(
                    live, extent.to(device), prompt.to(device), None if blocks is None else blocks.to(device))))
        if skipped is None:
            return [(iteration, index, micros) for iteration, index, _, micros in steps]
        need = torch.tensor([len(micros) for *_, micros in steps], device=self.device)
        if self._trainer is not None and self.trainer.world_size > 1:
            need = self.trainer.strategy.reduce(need, reduce_op="max")
        plan = []
        for (iteration, index, rows, micros), count in zip(steps, need.clamp(min=1).tolist()):
            if len(micros) < count:  # some rows of this minibatch were skipped: fill with them, shortest first
                idle = rows[skipped.to(rows.device)[rows]]
                idle = idle[torch.sort(extent.to(rows.device)[idle], stable=True).indices]
                micros = micros + [idle[j % idle.numel()].reshape(1) for j in range(count - len(micros))]
            plan.append((iteration, index, micros))
        return plan

    def _micro_batch(self, batch: RolloutBatch, rows: Tensor, advantages: Tensor,
                     weights: Tensor) -> tuple[RolloutBatch, Tensor, Tensor]:
        """The sub-batch of ``rows`` with its advantages and weights (with ``length_bucketing``: cut to the columns
        its rows use)."""
        mb, adv, w = batch.select(rows), advantages[rows], weights[rows]
        if self.length_bucketing:
            mb = trim_padding(mb)
            width = mb.loss_mask.shape[1]
            w = w[:, :width]
            if adv.shape[1] != 1:
                adv = adv[:, :width]
        return mb, adv, w

    def _check_finite(self, value: Tensor, what: str, iteration: int, minibatch: int) -> None:
        if not torch.isfinite(value).all():
            raise NonFiniteLossError(
                f"non-finite {what} ({value.item() if value.numel() == 1 else value}) at step {self.global_step} "
                f"(iteration {iteration}, minibatch {minibatch}); the weights were not updated"
            )

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters the optimiser steps (and whose gradient norm is clipped); methods with a critic add it."""
        return list(self.policy.parameters())

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        start = time.perf_counter()
        step = self.global_step  # updates done before this rollout
        advantages = self.compute_advantages(batch).detach()
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1)  # [N, 1], broadcast over tokens
        weights = self.loss_weights(batch)
        stats = self.update(batch, advantages, weights)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        update_time = time.perf_counter() - start
        metrics = {key: torch.stack([v.detach().float().reshape(()) for v in values]).mean()
                   for key, values in stats.items()}
        metrics.update(self.rollout_metrics(batch))
        step_time = batch.rollout_time + batch.reward_time + update_time
        metrics["perf/step_time"] = torch.tensor(step_time)
        metrics["perf/rollout_time"] = torch.tensor(batch.rollout_time)
        metrics["perf/reward_time"] = torch.tensor(batch.reward_time)
        metrics["perf/update_time"] = torch.tensor(update_time)
        metrics["perf/tokens_per_sec"] = batch.loss_mask.sum().float().cpu() / step_time
        self.log_training_metrics(metrics, step=step, batch_size=batch.num_rows)

    def update(self, batch: RolloutBatch, advantages: Tensor, weights: Tensor) -> dict[str, list[Tensor]]:
        """Optimise on one rollout batch: μ iterations × minibatches × micro-batches (see the module docstring).

        Returns the metrics of every micro-batch/step, averaged by ``training_step``. ``train/sampler_logp_diff``
        and ``train/entropy`` are measured on the first optimiser step's rows, before any update, as token
        means over every rank's tokens; the ``token_mean_metrics`` are token means over all the updates' tokens
        on every rank. Rows skipped as inert (``skip_inert_rows``) are not forwarded, so these token means are
        over the rows that were (``forwarded_rows``); the loss values and the gradient are those of every row.
        ``train/skipped_rows`` is the fraction of the batch's rows skipped (over all ranks).
        """
        optimizer = self.optimizers()
        weights = weights * self.num_minibatches  # each optimiser step at full-batch scale
        terms = self._loss_terms()
        skipped = self._skipped_rows(batch, advantages, terms)
        plan = self._update_plan(batch, skipped)
        if self.needs_proximal_logprobs and len(plan) > 1:
            batch = self._fill_proximal_logprobs(batch)
        forwarded = torch.zeros(batch.num_rows, dtype=torch.bool, device=batch.loss_mask.device)
        metrics = UpdateMetrics(self.token_mean_metrics, self.summed_metrics)
        for steps_done, (iteration, index, micro_batches) in enumerate(plan):
            optimizer.zero_grad()
            for micro in micro_batches:
                forwarded[micro] = True
                mb, mb_advantages, mb_weights = self._micro_batch(batch, micro, advantages, weights)
                measure = steps_done == 0
                out = self.forward_policy(mb, with_entropy=measure or self.needs_entropy,
                                          with_hidden=self.needs_hidden, extra_ids=self.extra_logprob_ids(mb))
                tokens = mb.loss_mask.sum().float()
                if measure:  # before any update: the learner vs the sampler that drew the tokens
                    diff = (out.logprobs.detach() - mb.sampler_logprobs).abs() * mb.loss_mask
                    metrics.add_tokens("train/sampler_logp_diff", diff.sum(), tokens)
                    metrics.add_tokens("train/entropy", out.entropy.detach().sum(), tokens)
                loss, loss_stats = self.policy_loss(mb, out, mb_advantages, mb_weights)
                for term in terms:
                    extra, extra_stats = term.loss_term(self, mb, out.logprobs, mb_weights)
                    loss = loss + extra
                    loss_stats = {**loss_stats, **extra_stats}
                self._check_finite(loss.detach(), "loss", iteration, index)
                if loss.requires_grad:  # e.g. not while a callback has frozen every parameter
                    self.manual_backward(loss)
                metrics.add_loss(loss, loss_stats, tokens)
            metrics.end_optimizer_step()
            params = [p for p in self.trainable_parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm or float("inf"))
            self._check_finite(grad_norm, "gradient norm", iteration, index)
            metrics.add("train/grad_norm", grad_norm)
            if steps_done == len(plan) - 1:
                optimizer.step()  # the one step Lightning counts: global_step = rollout batches
            else:
                optimizer.optimizer.step()
        self.forwarded_rows = forwarded
        metrics.add("train/skipped_rows", skipped.float().mean() if skipped is not None
                    else torch.zeros((), device=batch.loss_mask.device))
        optimizer.zero_grad()
        return metrics.finish(self._sum_over_ranks)

    def _sum_over_ranks(self, values: Tensor) -> Tensor:
        """``values`` summed over every rank (unchanged in one process)."""
        if self._trainer is not None and self.trainer.world_size > 1:
            return self.trainer.strategy.reduce(values, reduce_op="sum")
        return values

    def learning_rates(self) -> dict[str, Tensor]:
        """The learning rate of every optimiser parameter group, now: ``train/lr`` for the first group of the
        first optimiser (the policy), ``train/lr_<name>`` for each other group, ``name`` being the group's
        ``"name"`` entry if it has one (PPO: ``critic``), else its index over all the optimisers' groups."""
        if self._trainer is None or not self.trainer.optimizers:
            return {}
        rates: dict[str, Tensor] = {}
        groups = [group for optimizer in self.trainer.optimizers for group in optimizer.param_groups]
        for index, group in enumerate(groups):
            key = "train/lr" if index == 0 else f"train/lr_{group.get('name', index)}"
            if key in rates:  # two groups of the same name
                key = f"{key}_{index}"
            rates[key] = torch.tensor(float(group["lr"]))
        return rates

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Note the learning rates the coming update uses (``training_step`` steps the scheduler before it
        logs), so ``train/lr`` at step ``k`` is the rate step ``k`` was taken with. A subclass overriding this
        hook calls ``super()``."""
        self._step_learning_rates = self.learning_rates()

    def log_training_metrics(self, metrics: dict[str, Tensor], step: int, batch_size: int) -> None:
        """Average ``metrics`` over ranks and write them at ``step`` (the rollout's index, before its update).

        They go to the loggers directly, one point per rollout step, so the x-axis is the same as for
        ``val/reward`` and stays right across resumes; ``self.log`` feeds the progress bar and callbacks.
        The learning rates of the step's update (``learning_rates``) are added here.
        """
        rates, self._step_learning_rates = self._step_learning_rates, None
        metrics = {**(self.learning_rates() if rates is None else rates), **metrics}
        names = list(metrics)
        values = torch.stack([metrics[k].detach().float().to(self.device).reshape(()) for k in names])
        if self.trainer.world_size > 1:
            values = self.trainer.strategy.reduce(values, reduce_op="mean")
        reduced = dict(zip(names, values))
        self.log_dict(reduced, on_step=True, on_epoch=False, logger=False, batch_size=batch_size)
        self.log("reward", reduced["train/reward"], prog_bar=True, logger=False, batch_size=batch_size)
        if self.trainer.is_global_zero:
            scalars = {k: float(v) for k, v in reduced.items()}
            for logger in self.loggers:
                logger.log_metrics(scalars, step=step)

    def rollout_metrics(self, batch: RolloutBatch) -> dict[str, Tensor]:
        """The fixed rollout metrics of DESIGN.md (reward, spread, lengths, truncation); for multi-turn
        episodes also ``train/num_turns`` and ``train/env_errors`` (the latter also for a single-turn batch in which
        an environment failed an episode)."""
        rewards = batch.rewards.float()
        groups = rewards.view(-1, batch.group_size)
        episodes = {} if batch.num_turns is None else {"train/num_turns": batch.num_turns.float().mean()}
        if batch.num_turns is not None or batch.env_errors:
            episodes["train/env_errors"] = torch.tensor(float(batch.env_errors))
        return {**episodes,
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std(unbiased=False),
            # max == min, not std == 0: the std of a constant group of fractional rewards need not be exactly 0
            "train/zero_std_fraction": (groups.amax(dim=1) == groups.amin(dim=1)).float().mean(),
            "train/response_length": batch.response_lengths.float().mean(),
            "train/truncation_rate": batch.truncated.float().mean(),
        }

    # ================================================================== evaluation
    def validation_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self.val_reward.update(batch.rewards)
        if self._heldout_batch is None:
            self._heldout_batch = batch  # shown to the HeldoutObserver callbacks at the end of the validation

    def on_validation_epoch_end(self) -> None:
        """Log ``val/reward`` at ``step = global_step`` (the number of updates so far), like the step-0 entry,
        and show the first held-out batch to the ``HeldoutObserver`` callbacks."""
        value = self.val_reward.compute()  # synchronised over ranks
        self.val_reward.reset()
        batch, self._heldout_batch = self._heldout_batch, None
        self.log("val/reward", value, prog_bar=True, logger=False)
        if self.logger is not None and not self.trainer.sanity_checking:
            self.logger.log_metrics({"val/reward": float(value)}, step=self.global_step)
        if not self.trainer.sanity_checking:
            self._val_step = self.global_step
            self._record_val(self.global_step, float(value))
            if batch is not None:
                self._notify_heldout_observers(batch, self.global_step, float(value))

    def _heldout_observers(self) -> list[HeldoutObserver]:
        return [cb for cb in self.trainer.callbacks if isinstance(cb, HeldoutObserver)] if self._trainer else []

    def _notify_heldout_observers(self, batch: RolloutBatch, step: int, reward: float) -> None:
        for observer in self._heldout_observers():
            observer.on_heldout_evaluated(self.trainer, self, batch, step, reward)

    @torch.no_grad()
    def _evaluate_heldout(self, datamodule: Any) -> tuple[float, int, RolloutBatch | None]:
        """Greedy held-out evaluation outside Lightning's loop on this rank: ``(sum of rewards, count, first
        rollout batch)``; like ``datamodule.evaluate()``, keeping the first batch for the observers."""
        if not (hasattr(datamodule, "val_prompt_batches") and hasattr(datamodule, "rollout")):
            return (*datamodule.evaluate(), None)
        total, count, first = 0.0, 0, None
        for prompt_batch in datamodule.val_prompt_batches():
            rollout = datamodule.rollout(prompt_batch)
            total += float(rollout.rewards.sum())
            count += rollout.num_rows
            if first is None:
                first = rollout
        return total, count, first

    def _record_val(self, step: int, value: float) -> None:
        self.val_history = [(s, v) for s, v in self.val_history if s != step] + [(step, value)]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rl_lightning_val_step"] = self._val_step
        checkpoint["rl_lightning_val_history"] = [list(entry) for entry in self.val_history]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._val_step = int(checkpoint.get("rl_lightning_val_step", self._val_step))
        self.val_history = [(int(s), float(v)) for s, v in checkpoint.get("rl_lightning_val_history", [])]

    def on_train_start(self) -> None:
        """Log ``val/reward`` before training: at step 0 (the warm-start level) in a fresh run, and, on resume,
        at the checkpoint's step when that step is a validation step whose validation had not run yet (step
        checkpoints are written at the end of the training step, before its validation, which a resumed run
        would otherwise skip)."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "evaluate"):
            return
        step, interval = self.global_step, self.trainer.val_check_interval
        if self.trainer.limit_val_batches == 0:
            return  # validation switched off
        if step == 0:
            when = "before any update"
        elif self._val_step != step and isinstance(interval, int) and interval > 0 and step % interval == 0:
            when = "resumed from a checkpoint written before this step's validation"
        else:
            # resumed after this step's validation (an interrupt checkpoint): a resumed TensorBoard run has
            # purged the events from this step on, so write its value again (no new evaluation)
            done = dict(self.val_history)
            if step > 0 and self._val_step == step and step in done and self.logger is not None:
                self.logger.log_metrics({"val/reward": done[step]}, step=step)
            return
        self._log_heldout_evaluation(datamodule, when)

    def on_train_end(self) -> None:
        """Evaluate the final policy when the last step had no validation (``max_steps`` not a multiple of
        ``val_check_interval``, or a run stopped early), so that ``val/reward`` always ends at the last step."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if (datamodule is None or not hasattr(datamodule, "evaluate") or self.trainer.limit_val_batches == 0
                or self._val_step == self.global_step):
            return
        self._log_heldout_evaluation(datamodule, "after the last step")

    def _log_heldout_evaluation(self, datamodule: Any, when: str) -> None:
        """Evaluate on the held-out prompts outside Lightning's loop and log ``val/reward`` at ``global_step``."""
        step = self.global_step
        total, count, first = self._evaluate_heldout(datamodule)
        sums = torch.tensor([total, float(count)], device=self.device)
        sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        if float(sums[1]) == 0:
            return  # no held-out prompts: nothing to report
        value = float(sums[0] / sums[1])
        if self.logger is not None:
            self.logger.log_metrics({"val/reward": value}, step=step)
        self._val_step = step
        self._record_val(step, value)
        rank_zero_info(f"val/reward at step {step} ({when}): {value:.4f} on {int(sums[1])} held-out prompts")
        if first is not None:
            self._notify_heldout_observers(first, step, value)

