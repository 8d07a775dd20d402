"""``RLModule``: what every method shares; a method subclasses it and overrides a few narrow hooks.

``training_step`` reads as the algorithm: each ``LossTerm``'s ``prepare``, ``compute_advantages``, ``loss_weights``,
``update`` (per optimiser step and micro-batch of the ``UpdatePlan``: ``forward_policy``, ``policy_loss`` ``+
extra_losses + LossTerm``s, backward; clip, refuse non-finite values, step), then the step's log (``StepLog``
closes it). ``global_step`` counts rollout batches.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from rl_lightning.algorithms.advantages import Advantages, checked_advantages
from rl_lightning.algorithms.auxiliary import AuxiliaryRows, run_auxiliary
from rl_lightning.algorithms.checks import (
    GradClip, build_optimizer, check_finite, check_hook_output, check_module_settings, clip_gradients,
    check_bf16_setup, warn_misspelt_hooks,
)
from rl_lightning.algorithms.distributed import Ranks, shard_module
from rl_lightning.algorithms.evaluation import HeldoutEvaluation
from rl_lightning.algorithms.forward import LearnerForward, PolicyOutput, with_proximal_logprobs
from rl_lightning.algorithms.metrics import Metrics, Summed, UpdateMetrics, rollout_metrics, step_metrics
from rl_lightning.algorithms.protocols import LossTerm
from rl_lightning.algorithms.step_log import STEP_TOTALS, StepLog, StepLogging, StepTotals
from rl_lightning.algorithms.planning import (
    check_rollout_settings, require_data_setting, rollout_weights, zero_advantage_rows,
)
from rl_lightning.algorithms.update_plan import OptimizerStep, UpdatePlan
from rl_lightning.functional import AggregationMode, aggregate
from rl_lightning.models.adapters import LoraSettings, add_lora, omit_frozen_weights, policy_parameters
from rl_lightning.models.policy import DType, load_policy
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.inputs import RolloutInputs

class RLModule(LearnerForward, StepLogging, LightningModule):
    """Base of every algorithm: policy, optimiser, the step template and its hooks.

    Args:
        model_name_or_path: ``embedded:arithmetic`` (the packaged warm start), ``embedded:random``, or a local HF
            checkpoint directory. dtype: the policy's parameter dtype (``bfloat16`` for real models on GPU).
        optimizer: optimiser factory, e.g. ``{class_path: torch.optim.AdamW, init_args: {lr: 1e-4}}``.
        lr_scheduler: optional scheduler factory, stepped once per rollout batch.
        num_iterations: μ, passes over each rollout batch; num_minibatches: optimiser steps per pass.
        micro_batch_size: rows per forward/backward (gradient accumulation); ``None`` = the whole minibatch.
        loss_aggregation: how per-token losses are combined (see ``functional.aggregation_weights``);
            ``seq_mean_token_sum_norm`` divides by the constant ``loss_norm_length`` (Dr. GRPO: the token budget).
        max_grad_norm: gradient-norm clip (``None``: none; the norm is still logged), over every trainable parameter
            (grad_clip ``joint``) or per optimiser group (``per_group``: actor, critic; ``checks.clip_gradients``).
        logprob_chunk_size: token positions per log-softmax chunk. seed: seeds minibatch shuffling.
        skip_inert_rows: do not forward rows whose loss is exactly zero with zero gradient (``inert_rows``); the
            update is the same up to the rounding of a sum in another order (``train/skipped_rows``: the fraction).
        length_bucketing: order each minibatch's rows by response length before cutting micro-batches, and cut
            each to the columns its rows use (``planning.micro_batches``, ``planning.trim_padding``).
        share_prompt_forward: run a prompt several rows share once, with gradient (``forward.shared_prompt_forward``;
            the same log-probs and gradient; off by itself where it cannot be exact).
        lora: LoRA adapters on the policy (``models.adapters.LoraSettings``; ``configs/presets/lora.yaml``): only
            they train, a KL reference is the base with them off (no second copy), checkpoints leave the base out.
    """

    #: settings whose parent-class checks this class replaces with its own (``checks.check_settings``)
    relaxed_settings: frozenset[str] = frozenset()
    #: smallest ``data.group_size`` the method's advantages make sense for (2 for group baselines)
    min_group_size: int = 1
    #: ask ``forward_policy`` for a differentiable entropy (entropy bonuses) / the final hidden states (value heads)
    needs_entropy: bool = False
    needs_hidden: bool = False
    #: the loss reads the learner's log-probs before the update (``proximal_logprobs``): with several optimiser
    #: steps ``update`` fills ``batch.proximal_logprobs`` with one no-grad forward first
    needs_proximal_logprobs: bool = False
    #: this class's loss (``policy_loss`` + ``extra_losses``) of a row whose advantages are exactly 0 on all its
    #: tokens is exactly 0 with zero gradient (``Σ w · A · f(ρ)``), so ``inert_rows`` may skip it. A subclass that
    #: adds a term declares ``False``; ``tests/test_contract.py`` checks the claim for every registered method.
    zero_advantage_rows_are_inert: bool = False
    #: a forward shares its prompts only when that saves at least this many positions (the 2-core break-even)
    share_prompt_min_tokens: int = 64
    forwarded_rows: Tensor | None = None  #: ``[N]`` bool set by ``update``: the last batch's forwarded rows

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        warn_misspelt_hooks(cls)  # a method one edit from a hook would never be called

    def __init__(
        self, model_name_or_path: str = "embedded:arithmetic", dtype: DType = "float32",
        optimizer: OptimizerCallable = torch.optim.AdamW, lr_scheduler: LRSchedulerCallable | None = None,
        num_iterations: int = 1, num_minibatches: int = 1, micro_batch_size: int | None = None,
        loss_aggregation: AggregationMode = "seq_mean_token_mean", max_grad_norm: float | None = 1.0,
        logprob_chunk_size: int = 256, seed: int = 0, skip_inert_rows: bool = True, length_bucketing: bool = True,
        share_prompt_forward: bool = True, loss_norm_length: int | None = None, lora: LoraSettings | None = None,
        grad_clip: GradClip = "joint",
    ) -> None:
        super().__init__()
        check_module_settings(self, dict(skip_inert_rows=skip_inert_rows, length_bucketing=length_bucketing,
                                         share_prompt_forward=share_prompt_forward), dict(
            num_iterations=num_iterations, num_minibatches=num_minibatches, logprob_chunk_size=logprob_chunk_size),
            micro_batch_size, max_grad_norm, loss_norm_length, loss_aggregation, grad_clip)
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", "lora"])
        self.hparams["lora"] = asdict(lora) if lora is not None else None  # plain data in checkpoints
        self.optimizer_factory, self.lr_scheduler_factory = optimizer, lr_scheduler
        self.num_iterations, self.num_minibatches = num_iterations, num_minibatches
        self.micro_batch_size, self.loss_aggregation = micro_batch_size, loss_aggregation
        self.max_grad_norm, self.grad_clip = max_grad_norm, grad_clip
        self.logprob_chunk_size, self.seed = logprob_chunk_size, seed
        self.skip_inert_rows, self.length_bucketing = skip_inert_rows, length_bucketing
        self.share_prompt_forward, self.loss_norm_length = share_prompt_forward, loss_norm_length
        self.policy, self.tokenizer = load_policy(model_name_or_path, dtype)
        if lora is not None:  # only the adapters train; checkpoints hold them, not the base (reloaded from its path)
            self.policy = add_lora(self.policy, lora)
            omit_frozen_weights(self, "policy")
        self.policy.train()  # from_pretrained returns eval mode; Lightning toggles modes from here on
        self.automatic_optimization = False

    # ================================================================== hooks for methods
    def compute_advantages(self, batch: RolloutBatch) -> Tensor | Advantages:
        """Advantages ``[N]`` (one per response) or ``[N, T]`` (per token), or an ``Advantages`` with more."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_advantages")

    def policy_loss(self, batch: RolloutBatch, out: PolicyOutput, adv: Advantages,
                    weights: Tensor) -> tuple[Tensor, Metrics]:
        """The loss on ``batch``'s rows and its metrics (``out``: their ``forward_policy``; ``weights`` ``[n, T]``).
        Default: ``-Σ w · policy_objective(ρ, A)``, ``ρ = exp(log π_θ - log π_old)`` (``π_old``: ratio_reference)."""
        mask = batch.loss_mask
        ratio = torch.exp((out.logprobs - self.ratio_reference(batch, out).detach()) * mask)  # 1 on padding
        objective, metrics = self.policy_objective(batch, out, ratio, adv)
        check_hook_output(self, "policy_objective", objective, [tuple(mask.shape)],
                          "[n, T]: one value per token of the micro-batch's rows")
        loss = -aggregate(objective * mask, weights)
        return loss, {"train/policy_loss": Summed(loss.detach()), **metrics}

    def policy_objective(self, batch: RolloutBatch, out: PolicyOutput, ratio: Tensor,
                         adv: Advantages) -> tuple[Tensor, Metrics]:
        """``[n, T]`` the per-token objective to maximise from ``ρ`` (torchrl's ``_compute_policy_objective``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement policy_objective or policy_loss")

    def ratio_reference(self, batch: RolloutBatch, out: PolicyOutput) -> Tensor:
        """``[n, T]`` ``log π_old`` of the ratio: the sampler's recorded log-probs (GRPO's TIS: the proximal policy)."""
        return batch.sampler_logprobs

    def extra_losses(self, batch: RolloutBatch, out: PolicyOutput, adv: Advantages,
                     weights: Tensor) -> list[tuple[Tensor, Metrics]]:
        """Further ``(term, metrics)`` added to ``policy_loss`` in order (PPO's value loss, CoPE's forecasting)."""
        return []

    def auxiliary_rows(self, batch: RolloutBatch, adv: Advantages) -> list[AuxiliaryRows] | None:
        """Rows besides the rollout's, each set with its own loss, in the same optimiser steps (``auxiliary.py``)."""
        return None

    def before_update(self, batch: RolloutBatch, adv: Advantages, weights: Tensor) -> dict[str, list[Tensor]]:
        """Work and metrics before the policy's optimiser steps (PPO's critic passes). Default: none."""
        return {}

    def after_update(self, batch: RolloutBatch, adv: Advantages) -> dict[str, list[Tensor]]:
        """Work and metrics after them, on the updated policy (SPO's tracker). Default: none."""
        return {}

    def inert_rows(self, batch: RolloutBatch, adv: Advantages) -> Tensor | None:
        """``[N]`` bool: the rows whose every loss term is exactly zero with zero gradient (not forwarded, their
        weights already in the normaliser), or ``None`` when the method cannot tell (the same on every rank)."""
        if not self.zero_advantage_rows_are_inert or self.needs_entropy or self.needs_hidden:
            return None
        return zero_advantage_rows(batch, adv.advantages)

    def inert_row_metrics(self, batch: RolloutBatch, rows: Tensor, weights: Tensor) -> dict[str, Tensor]:
        """Summed metrics of a step's not-forwarded ``rows`` (``[N]`` bool; FlashREINFORCE counts them kept)."""
        return {}

    def extra_logprob_ids(self, batch: RolloutBatch) -> Tensor | None:
        """``[n, T, J]`` ids at which the loss also needs the learner's log-probs (the sampler's top-k, aux draws)."""
        return None

    def check_datamodule(self, datamodule: Any) -> None:
        """Refuse data settings the method cannot use (called at setup). Default: accept everything."""

    def rollout_inputs(self) -> RolloutInputs:
        """What the method's rollouts need from it (branches, prompt weights), read once by the data module."""
        return RolloutInputs()

    def rollout_metrics(self, batch: RolloutBatch) -> dict[str, Tensor]:
        """The step's rollout metrics (``metrics.rollout_metrics``); a method may add its own."""
        return rollout_metrics(batch)

    def parameter_groups(self) -> list[dict[str, Any]]:
        """Optimiser groups: the policy's (settings from ``optimizer``), then ``component_groups``."""
        return [{"params": policy_parameters(self.policy)}, *self.component_groups()]

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What the optimiser steps and the gradient clip sees: the parameters of ``parameter_groups``."""
        return [p for group in self.parameter_groups() for p in group["params"]]

    def component_groups(self) -> list[dict[str, Any]]:
        """Groups the policy's step also steps (a generative critic's own weights or adapters). Default: none."""
        return []

    # ================================================================== the step
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> dict[str, StepTotals]:
        start, step = time.perf_counter(), self.global_step  # updates done before this rollout
        rates = self.learning_rates()  # the rates this update uses (the scheduler steps after it)
        for term in self._loss_terms():
            batch = term.prepare(self, batch)
        adv = checked_advantages(self, self.compute_advantages(batch), tuple(batch.loss_mask.shape))  # [N, 1] or [N, T]
        stats = self.update(batch, adv, self.loss_weights(batch))
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        metrics = {**rates, **step_metrics(stats, batch, time.perf_counter() - start), **self.rollout_metrics(batch)}
        totals = self.log_training_metrics(metrics, step=step, batch_size=batch.num_rows, tokens=batch.loss_mask.sum())
        return {STEP_TOTALS: totals}  # to StepLog's on_train_batch_end: perf/step_time at the step's end

    def update(self, batch: RolloutBatch, adv: Advantages, weights: Tensor) -> dict[str, list[Tensor]]:
        """μ passes x minibatches optimiser steps of micro-batches (``update_plan.UpdatePlan``); their metrics."""
        before = self.before_update(batch, adv, weights)
        optimizer, terms, metrics = self.optimizers(), self._loss_terms(), UpdateMetrics()
        if self.needs_proximal_logprobs and self.num_iterations * self.num_minibatches > 1:
            batch = with_proximal_logprobs(self.forward_policy, batch, self.micro_batch_size)
        plan = UpdatePlan.build(self, batch, adv, weights * self.num_minibatches, terms)
        for step in plan:
            optimizer.zero_grad()
            for mb in step:
                out = self.forward_policy(mb.batch, with_entropy=step.first or self.needs_entropy,
                                          with_hidden=self.needs_hidden, extra_ids=self.extra_logprob_ids(mb.batch))
                if step.first:  # before any update: the learner vs the sampler that drew the tokens
                    metrics.add_sampler_gap(mb.batch, out)
                loss, stats = self.policy_loss(mb.batch, out, mb.adv, mb.weights)
                for term, term_stats in [*self.extra_losses(mb.batch, out, mb.adv, mb.weights),
                                         *(t.loss_term(self, mb.batch, out.logprobs, mb.weights) for t in terms)]:
                    loss, stats = loss + term, {**stats, **term_stats}
                check_finite(loss.detach(), "loss", self.global_step, step.iteration, step.index)
                if loss.requires_grad:  # e.g. not while a callback has frozen every parameter
                    self.manual_backward(loss)
                metrics.add_loss(loss, stats, mb.batch.loss_mask.sum().float())
            run_auxiliary(self, step.auxiliary, metrics, step.iteration, step.index)
            idle = self.inert_row_metrics(plan.batch, step.idle, plan.weights) if bool(step.idle.any()) else {}
            metrics.add_summed(idle)
            metrics.end_optimizer_step()
            self._optimizer_step(optimizer, metrics, step)
        self.forwarded_rows = plan.forwarded
        metrics.add("train/skipped_rows", plan.skipped_fraction)
        metrics.add("perf/optimizer_steps", plan.forwarded.new_tensor(float(len(plan)), dtype=torch.float))
        optimizer.zero_grad()
        return {**before, **metrics.finish(self.ranks.sum if self.ranks.world_size > 1 else None),
                **plan.auxiliary_metrics, **self.after_update(batch, adv)}

    # ================================================================== shared machinery
    @property
    def ranks(self) -> Ranks:
        """The collectives of this run (``Ranks``; one process outside a Trainer)."""
        return Ranks(self._trainer)

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (FSDP2), shard policy and critic per decoder block (``shard_module``)."""
        shard_module(self, self.device_mesh)

    def configure_callbacks(self) -> list[Callback]:
        """Every run's callbacks: the held-out evaluation (``val/reward``) and, last, the step's log (``StepLog``)."""
        return [HeldoutEvaluation(), StepLog()]

    @property
    def val_history(self) -> list[tuple[int, float]]:
        """``(step, val/reward)`` of every held-out evaluation of this run (``HeldoutEvaluation.history``)."""
        callbacks = self.trainer.callbacks if self._trainer else []
        return next((cb.history for cb in callbacks if isinstance(cb, HeldoutEvaluation)), [])

    def configure_optimizers(self) -> Any:
        optimizer, make = build_optimizer(self.optimizer_factory, self.parameter_groups()), self.lr_scheduler_factory
        return optimizer if make is None else {"optimizer": optimizer, "lr_scheduler": make(optimizer)}

    def setup(self, stage: str) -> None:
        if (datamodule := getattr(self.trainer, "datamodule", None)) is not None:
            check_rollout_settings(self, datamodule, self.trainer.world_size, stage)
            self.check_datamodule(datamodule)
        check_bf16_setup(self.trainer, self.hparams.get("dtype"))

    def require_data_setting(self, datamodule: Any, setting: str, what: str, minimum: int = 1) -> None:
        """For ``check_datamodule``: ``planning.require_data_setting`` (refuse ``setting < minimum``, by field)."""
        require_data_setting(self, datamodule, setting, what, minimum)

    def loss_weights(self, batch: RolloutBatch) -> Tensor:
        """Aggregation weights ``[N, T]`` of the whole rollout batch over every rank (``planning.rollout_weights``)."""
        return rollout_weights(batch, self.loss_aggregation, self.ranks, self.loss_norm_length)

    def validation_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        """Nothing: ``HeldoutEvaluation`` reads each held-out batch (``on_validation_batch_end``)."""

    def _loss_terms(self) -> list[LossTerm]:
        return [cb for cb in self.trainer.callbacks if isinstance(cb, LossTerm)] if self._trainer else []

    def _optimizer_step(self, optimizer: Any, metrics: UpdateMetrics, step: OptimizerStep) -> None:
        groups = self.parameter_groups() if self.grad_clip == "per_group" else []  # joint: no second list per step
        grad_norm, group_norms = clip_gradients(self.trainable_parameters(), groups, self.max_grad_norm, self.grad_clip)
        check_finite(grad_norm, "gradient norm", self.global_step, step.iteration, step.index)
        metrics.add("train/grad_norm", grad_norm)
        for name, norm in group_norms.items():
            metrics.add(f"train/grad_norm_{name}", norm)
        (optimizer.step if step.last else optimizer.optimizer.step)()  # the last is Lightning's: global_step
