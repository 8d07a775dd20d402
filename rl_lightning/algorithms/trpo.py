"""TRPO: a natural-gradient step inside a KL trust region (Schulman et al. 2015, arXiv 1502.05477).

Per rollout batch, with θ_old the weights at the start of the update::

    S(θ) = Σ_{i,t} w_{i,t} ρ_{i,t} A_{i,t},  ρ = π_θ / π_old     (π_old here: the sampler's recorded log-probs)
    g = ∇S(θ_old)
    F v = ∇²KL̄(π_old ‖ π_θ) v + damping · v     (KL̄: token-mean full-vocabulary KL over generated tokens,
                                                 π_old here: the policy's own distribution at θ_old)
    x ≈ F⁻¹ g (conjugate gradient);  full step s = sqrt(2δ / xᵀFx) · x
    θ_new = θ_old + c^k s for the first k = 0..backtrack_iters with S(θ_new) > S(θ_old) and KL̄ <= δ, else θ_old

Not PPO: there is no clipping, no learning rate and one parameter change per rollout batch. The change goes
through a plain SGD(lr=1) optimiser with ``grad = -step`` so Lightning counts it as the batch's one global step.

``F v`` comes in Gauss-Newton form by default (``fisher_product: gauss_newton``): ``Jᵀ M J v`` from two
first-order passes through one kept forward of the logits, in which each distinct prompt goes through the network
once (``fisher_logits``), and ``F x`` for the step scale from CG's own residual; the same matrix to floating-point
rounding as the double backward through the KL (``double_backward``, the original path), so the same step to
what CG's float32 sensitivity allows (``docs/performance.md``), measured 2.3-3.3x faster per update
(``experiments/bench_trpo.py``).
Not validated at scale: F⁻¹g needs the ``[N, T, V]`` full-vocabulary log-probs and second-order autograd
through the whole policy (a backward of a backward), which is cheap for the embedded model and expensive for
real LLMs (single process only).
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.base import Metrics, PolicyOutput, RLModule
from rl_lightning.algorithms.checks import NonFiniteLossError, check_settings
from rl_lightning.algorithms.critic import CriticLearner
from rl_lightning.algorithms.natural_gradient import (
    apply_step, fisher_logits, step_metrics, trust_region_step, vocab_logprobs,
)
from rl_lightning.functional import group_advantages, sampling_log_softmax
from rl_lightning.functional.trpo import (
    backtracking_line_search, categorical_kl, fisher_vector_product, gauss_newton_vector_product, importance_surrogate,
)
from rl_lightning.models.adapters import actor_parameters, policy_parameters
from rl_lightning.models.value import CriticMode
from rl_lightning.rollout.batch import RolloutBatch

AdvantageEstimator = Literal["group", "gae"]
FisherProduct = Literal["gauss_newton", "double_backward"]


class TRPO(RLModule):
    """Trust Region Policy Optimization.

    Args:
        delta: trust-region radius δ, the largest accepted mean KL(π_old ‖ π_new) per token (nats); > 0.
        damping: multiple of the identity added to the Fisher matrix (keeps conjugate gradient well posed).
        cg_iters: conjugate-gradient iterations (Fisher-vector products) per step.
        backtrack_iters: line-search shrinkings after the full step (``backtrack_iters + 1`` trials in all).
        backtrack_coeff: step fraction factor c in ``(0, 1)``: trial k uses ``c^k`` of the full step.
        fisher_subsample: estimate the Fisher matrix on every k-th row of the batch only (OpenAI baselines' TRPO
            uses 5): each conjugate-gradient product costs about 1/k as much; ``g`` and the line search (surrogate
            and KL) always use the whole batch. 1 = the exact batch Fisher.
        fisher_product: how ``F v`` is computed, the same matrix either way (to floating-point rounding):
            ``gauss_newton`` -- ``Jᵀ M J v`` (``functional.gauss_newton_vector_product``) on ``fisher_logits``
            (each distinct prompt through the network once), ``F x`` for the step scale from CG's residual, 2.3-3.3x
            faster; ``double_backward`` -- the Hessian-vector product of the KL by double backpropagation
            (``functional.fisher_vector_product``) on ``vocab_logprobs``, plus a last product for ``F x``.
        advantage_estimator: ``group`` -- GRPO's ``(R - μ_G) / (σ_G + std_eps)`` (``functional.group_advantages``);
            ``gae`` -- per-token GAE over a critic's values (as in PPO), the critic fitted by Adam on the value loss.
        scale_rewards: with ``group``, divide by σ_G; ``False`` gives ``R - μ_G``.
        std_eps: with ``group``, added to σ_G.
        critic: with ``gae``, ``shared`` -- a value head on the policy's (detached) hidden states, so only the
            trust-region step moves the policy; ``separate`` -- its own network from ``critic_model_name_or_path``.
        critic_model_name_or_path: checkpoint of the separate critic (``None``: ``model_name_or_path``).
        critic_lr: Adam learning rate of the critic.
        critic_steps: Adam steps on the value loss per rollout batch (before the policy step).
        gamma: with ``gae``, discount γ.
        lam: with ``gae``, λ.
        whiten_advantages: with ``gae``, normalise the advantages over the batch's generated tokens.
        **kwargs: ``RLModule`` arguments (model, dtype, loss_aggregation, ...). The policy ``optimizer``,
            ``lr_scheduler``, ``max_grad_norm`` and ``micro_batch_size`` play no part (the step length is set by
            δ); ``num_iterations`` and ``num_minibatches`` must be 1.

    Logs ``train/kl_after_step``, ``train/line_search_steps``, ``train/step_accepted``,
    ``train/surrogate_improvement``, ``train/expected_improvement``, ``train/grad_norm`` (of g), and with ``gae``
    ``train/value_loss`` and ``train/explained_variance``.
    """

    def __init__(
        self,
        delta: float = 0.01,
        damping: float = 0.1,
        cg_iters: int = 10,
        backtrack_iters: int = 10,
        backtrack_coeff: float = 0.5,
        fisher_subsample: int = 1,
        fisher_product: FisherProduct = "gauss_newton",
        advantage_estimator: AdvantageEstimator = "group",
        scale_rewards: bool = True,
        std_eps: float = 1e-6,
        critic: CriticMode = "shared",
        critic_model_name_or_path: str | None = None,
        critic_lr: float = 1e-3,
        critic_steps: int = 4,
        gamma: float = 1.0,
        lam: float = 0.95,
        whiten_advantages: bool = True,
        **kwargs: Any,
    ) -> None:
        check_settings(self, [("critic_steps", critic_steps, isinstance(critic_steps, int) and critic_steps >= 1,
                               "must be >= 1")])
        super().__init__(**kwargs)
        #: the critic, only with ``advantage_estimator: gae`` (fitted by Adam on ½ (V - R)² before the policy step)
        self.critic_learner = CriticLearner(self, critic, critic_model_name_or_path, critic_lr, value_clip=None,
                                            updates=critic_steps) if advantage_estimator == "gae" else None
        checks = [  # (field, valid, rule, value)
            ("delta", delta > 0, "must be > 0", delta),
            ("damping", damping >= 0, "must be >= 0", damping),
            ("cg_iters", cg_iters >= 1, "must be >= 1", cg_iters),
            ("backtrack_iters", backtrack_iters >= 0, "must be >= 0", backtrack_iters),
            ("backtrack_coeff", 0 < backtrack_coeff < 1, "must be in (0, 1)", backtrack_coeff),
            ("fisher_subsample", fisher_subsample >= 1, "must be >= 1", fisher_subsample),
            ("fisher_product", fisher_product in ("gauss_newton", "double_backward"),
             "must be 'gauss_newton' or 'double_backward'", fisher_product),
            ("advantage_estimator", advantage_estimator in ("group", "gae"), "must be 'group' or 'gae'",
             advantage_estimator),
            ("critic_lr", critic_lr > 0, "must be > 0", critic_lr),
            ("gamma", 0 <= gamma <= 1, "must be in [0, 1]", gamma),
            ("lam", 0 <= lam <= 1, "must be in [0, 1]", lam),
            ("num_iterations", self.num_iterations == 1, "must be 1 (one trust-region step per rollout batch)",
             self.num_iterations),
            ("num_minibatches", self.num_minibatches == 1, "must be 1 (one trust-region step per rollout batch)",
             self.num_minibatches),
            ("lr_scheduler", self.lr_scheduler_factory is None, "must be null (TRPO has no learning rate)",
             self.lr_scheduler_factory),
        ]
        check_settings(self, [(name, value, ok, rule) for name, ok, rule, value in checks])
        self.delta, self.damping = delta, damping
        self.cg_iters, self.backtrack_iters, self.backtrack_coeff = cg_iters, backtrack_iters, backtrack_coeff
        self.fisher_subsample, self.fisher_product = fisher_subsample, fisher_product
        self.advantage_estimator = advantage_estimator
        self.min_group_size = 2 if advantage_estimator == "group" else 1  # group-relative advantages need G >= 2
        self.scale_rewards, self.std_eps = scale_rewards, std_eps
        self.critic_steps, self.critic_lr = critic_steps, critic_lr
        self.gamma, self.lam, self.whiten_advantages = gamma, lam, whiten_advantages

    # ------------------------------------------------------------------ setup
    @override
    def configure_optimizers(self) -> Any:
        # The policy "optimiser" only applies the accepted step: grad = -step, lr = 1 -> θ += step.
        policy = torch.optim.SGD(actor_parameters(self.policy), lr=1.0, momentum=0.0, weight_decay=0.0)
        if self.critic_learner is None:
            return policy
        return [policy, torch.optim.Adam([self.critic_learner.parameter_group()], lr=self.critic_lr)]

    @override
    def learning_rates(self) -> dict[str, Tensor]:
        """Only the critic's (``train/lr_critic``, with ``gae``): the policy has no learning rate (its step
        length comes from δ; the SGD "optimiser" with ``lr = 1`` only applies it)."""
        rates = super().learning_rates()
        rates.pop("train/lr", None)
        return rates

    @override
    def trainable_parameters(self) -> list[nn.Parameter]:
        return policy_parameters(self.policy)

    @override
    def check_datamodule(self, datamodule: Any) -> None:
        if self.trainer.world_size > 1:
            raise ValueError(f"TRPO runs in a single process (the CG step is not distributed), got "
                             f"world_size={self.trainer.world_size}")
        top_p = getattr(getattr(datamodule, "sampling", None), "top_p", 1.0)  # another data module class: untruncated
        if top_p < 1.0:
            rank_zero_warn(
                f"TRPO with data.init_args.sampling.top_p={top_p}: the trust region is measured between the "
                "top-p-truncated distributions, and a step that moves any token of pi_old's nucleus out of pi_new's "
                "makes the KL infinite, so the line search rejects it; expect many rejected steps (top_p: 1.0 avoids "
                "this)"
            )

    # ------------------------------------------------------------------ hooks
    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor | Advantages:
        if self.critic_learner is None:
            return group_advantages(batch.rewards, batch.group_size, scale=self.scale_rewards, eps=self.std_eps)
        return self.critic_learner.gae(batch, self.gamma, self.lam, self.whiten_advantages)

    @override
    def policy_loss(self, batch: RolloutBatch, out: PolicyOutput, adv: Advantages,
                    weights: Tensor) -> tuple[Tensor, Metrics]:
        """``-S(θ)``: minus the importance-weighted surrogate (TRPO maximises ``S``)."""
        surrogate = importance_surrogate(out.logprobs, batch.sampler_logprobs, adv.advantages, batch.loss_mask,
                                         weights)
        return -surrogate, {}

    def accept_step(self, improvement: Tensor, kl: Tensor) -> bool:
        """The line-search test of one trial step: the surrogate improves and the measured KL is within δ."""
        return bool(torch.isfinite(improvement) and torch.isfinite(kl) and improvement > 0 and kl <= self.delta)

    # ------------------------------------------------------------------ pieces of the step
    def vocab_logprobs(self, batch: RolloutBatch) -> Tensor:
        """``[N, T, V]`` the policy's full-vocabulary log-probs (``natural_gradient.vocab_logprobs``)."""
        return vocab_logprobs(self.policy, batch)

    def objective(
        self, batch: RolloutBatch, logp_all: Tensor, adv: Advantages, weights: Tensor
    ) -> tuple[Tensor, Tensor, Metrics]:
        """``(S, logprobs [N, T], metrics)``: ``-policy_loss`` minus every callback ``LossTerm`` (e.g. a KL penalty)."""
        mask = batch.loss_mask
        logprobs = logp_all.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) * mask  # [N, T]
        loss, stats = self.policy_loss(batch, PolicyOutput(logprobs), adv, weights)
        for term in self._loss_terms():
            extra, extra_stats = term.loss_term(self, batch, logprobs, weights)
            loss = loss + extra
            stats = {**stats, **extra_stats}
        return -loss, logprobs, stats

    def fisher_logits(self, batch: RolloutBatch) -> Tensor:
        """``[N, T, V]`` logits for the Gauss-Newton products, each distinct prompt through the network once
        (``natural_gradient.fisher_logits``)."""
        return fisher_logits(self.policy, batch)

    def fisher_vector_product(self, batch: RolloutBatch, damping: float | None = None,
                              method: FisherProduct | None = None) -> Callable[[Tensor], Tensor]:
        """``v -> F v + damping v`` at the current weights on ``batch`` (F: Hessian of the mean full-vocab KL),
        by ``method`` (default ``fisher_product``)."""
        params = self.trainable_parameters()
        damping = self.damping if damping is None else damping
        if (method or self.fisher_product) == "double_backward":
            new = self.vocab_logprobs(batch)
            kl = categorical_kl(new.detach(), new, batch.loss_mask)
            return fisher_vector_product(kl, params, damping)
        logits = self.fisher_logits(batch)
        with torch.no_grad():
            old = sampling_log_softmax(logits, batch.temperature, batch.top_p, keep=batch.response_ids)
        return gauss_newton_vector_product(logits, old, batch.loss_mask, params, batch.temperature, damping)

    # ------------------------------------------------------------------ the update
    @override
    def update(self, batch: RolloutBatch, adv: Advantages, weights: Tensor) -> dict[str, list[Tensor]]:
        """One trust-region step on the rollout batch (see the module docstring); one global step."""
        optimizers = self.optimizers()
        policy_opt = optimizers[0] if isinstance(optimizers, list) else optimizers
        stats: dict[str, list[Tensor]] = {}
        if self.critic_learner is not None:  # critic_steps full-batch Adam steps on ½ (V - R)² first
            stats.update({**self.critic_learner.metrics(batch, adv),
                          **self.critic_learner.fit(batch, adv, weights, optimizers[1])})
        params = self.trainable_parameters()
        mask = batch.loss_mask

        # π_old's full distribution (the policy at θ_old) and the surrogate with its gradient g
        new_logp = self.vocab_logprobs(batch)  # [N, T, V], carries the graph
        old_logp = new_logp.detach()
        surrogate, logprobs, term_stats = self.objective(batch, new_logp, adv, weights)
        if not torch.isfinite(surrogate):
            raise NonFiniteLossError(f"TRPO: non-finite surrogate ({surrogate.item()}) at step {self.global_step}; "
                                     "the weights were not updated")
        reuse = self.fisher_product == "double_backward" and self.fisher_subsample == 1  # its KL needs this graph
        grads = torch.autograd.grad(surrogate, params, retain_graph=reuse, allow_unused=True)
        g = torch.cat([(gr if gr is not None else torch.zeros_like(p)).reshape(-1) for gr, p in zip(grads, params)])

        # natural direction x = F⁻¹ g by CG (float64), scaled to the edge of the quadratic trust region; the
        # products on every fisher_subsample-th row only (a sub-batch's forward, so each product is cheaper too)
        sub = batch if self.fisher_subsample == 1 else batch.select(
            torch.arange(0, batch.num_rows, self.fisher_subsample, device=mask.device))
        fvp = (fisher_vector_product(categorical_kl(old_logp, new_logp, mask), params, self.damping) if reuse
               else self.fisher_vector_product(sub))
        full_step = trust_region_step(fvp, g, self.cg_iters, self.delta, self.fisher_product == "gauss_newton")
        if not torch.isfinite(full_step).all():
            raise NonFiniteLossError(f"TRPO: non-finite step at step {self.global_step}; the weights were not updated")

        del fvp, grads, new_logp, sub  # free the products' graphs before the line search
        surrogate, logprobs = surrogate.detach(), logprobs.detach()
        # backtracking line search on the real KL and surrogate; the weights are restored afterwards
        s_old = surrogate

        def evaluate() -> tuple[Tensor, Tensor]:
            trial_logp = self.vocab_logprobs(batch)
            improvement = self.objective(batch, trial_logp, adv, weights)[0] - s_old
            return improvement, categorical_kl(old_logp, trial_logp, mask)

        accepted = backtracking_line_search(params, full_step, evaluate, self.accept_step, self.backtrack_iters,
                                            self.backtrack_coeff)

        apply_step(policy_opt, params, accepted[1] if accepted else None)  # one counted step per rollout batch

        stats.update(step_metrics(accepted, g, full_step, s_old, old_logp, logprobs, batch, self.backtrack_iters))
        for key, value in term_stats.items():
            stats[key] = [getattr(value, "value", value).detach().float()]
        stats["perf/optimizer_steps"] = [mask.new_tensor(1.0, dtype=torch.float)]  # one trust-region step
        return stats
