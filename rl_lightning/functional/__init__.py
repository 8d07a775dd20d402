"""The math of the spec as pure torch functions: no Lightning, no models, nothing else of the package.

Shapes: per-sequence ``[N]``, per-token ``[N, T]``, ``mask [N, T]`` (1 on model-generated tokens); groups are
contiguous blocks of ``group_size`` rows.
"""

from rl_lightning.functional.advantages import (
    baseline_advantages,
    batch_centered_advantages,
    ema_update,
    gae,
    group_advantages,
    leave_one_out_advantages,
    outcome_gae,
    outcome_token_rewards,
)
from rl_lightning.functional.credit import (
    anchored_credit,
    group_step_normalized,
    group_step_std,
    interpolated_values,
    turn_mask_from_index,
    turn_token_advantages,
)
from rl_lightning.functional.critics import (
    band_mask_weights,
    bounded_value,
    divergence_clip_bounds,
    length_adaptive_lambda,
    variance_weights,
)
from rl_lightning.functional.forecasting import forecast_loss, forecast_pairs, forecast_weights
from rl_lightning.functional.gates import bernoulli_kl, trajectory_gate
from rl_lightning.functional.kl import KLKind, kl_estimate
from rl_lightning.functional.centering import (
    head_mass,
    mc_centered_loss,
    score_centered_loss,
    score_centering_coefficients,
    tail_ratio,
    truncated_importance_weights,
)
from rl_lightning.functional.logprobs import (
    sampling_log_softmax,
    sampling_logits,
    sampling_logprobs,
    sampling_logprobs_at,
    top_p_mask,
)
from rl_lightning.functional.losses import (
    AggregationMode,
    PolicyGradientStats,
    PolicyLossStats,
    aggregate,
    aggregation_weights,
    clip_statistics,
    clipped_policy_loss,
    clipped_surrogate,
    clipped_value_loss,
    explained_variance,
    policy_gradient_loss,
    ValueLossStats,
)
from rl_lightning.functional.masked import masked_mean, masked_sum, masked_whiten
from rl_lightning.functional.tracker import (
    beta_tracker_update,
    normalized_advantages,
    spo_discount,
    tracker_sampling_weights,
    tracker_value,
)
from rl_lightning.functional.trpo import (
    categorical_kl,
    conjugate_gradient,
    fisher_vector_product,
    gauss_newton_vector_product,
    importance_surrogate,
    trust_region_scale,
)

__all__ = [
    "anchored_credit",
    "group_step_normalized",
    "group_step_std",
    "interpolated_values",
    "turn_mask_from_index",
    "turn_token_advantages",
    "variance_weights",
    "length_adaptive_lambda",
    "divergence_clip_bounds",
    "bounded_value",
    "band_mask_weights",
    "sampling_logprobs_at",
    "truncated_importance_weights",
    "tail_ratio",
    "score_centering_coefficients",
    "score_centered_loss",
    "mc_centered_loss",
    "head_mass",
    "AggregationMode",
    "KLKind",
    "PolicyGradientStats",
    "PolicyLossStats",
    "ValueLossStats",
    "aggregate",
    "aggregation_weights",
    "baseline_advantages",
    "beta_tracker_update",
    "batch_centered_advantages",
    "bernoulli_kl",
    "categorical_kl",
    "clip_statistics",
    "clipped_policy_loss",
    "clipped_surrogate",
    "clipped_value_loss",
    "conjugate_gradient",
    "ema_update",
    "explained_variance",
    "fisher_vector_product",
    "forecast_loss",
    "forecast_pairs",
    "forecast_weights",
    "gae",
    "gauss_newton_vector_product",
    "group_advantages",
    "importance_surrogate",
    "kl_estimate",
    "leave_one_out_advantages",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "normalized_advantages",
    "outcome_gae",
    "outcome_token_rewards",
    "policy_gradient_loss",
    "sampling_log_softmax",
    "sampling_logits",
    "sampling_logprobs",
    "spo_discount",
    "top_p_mask",
    "trajectory_gate",
    "tracker_sampling_weights",
    "tracker_value",
    "trust_region_scale",
]
