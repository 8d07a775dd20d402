"""The data module's settings, grouped: how training rollouts are sampled, what the sampler records beside them,
how prompts are encoded, how held-out evaluation runs, and the asynchronous producer.

Each group is a frozen dataclass that checks its own values, so a bad value is refused when the configuration is
read, naming its key (``data.init_args.sampling.temperature``). In a config each group is one mapping::

    data:
      class_path: rl_lightning.rollout.RolloutDataModule
      init_args:
        prompts_per_step: 16
        group_size: 8
        sampling: {max_new_tokens: 8, temperature: 1.0}    # the fields left out keep their defaults
        evaluation: {batch_size: 256}

and on the command line ``--data.init_args.sampling.temperature 0.7``. Stacked configs merge a group field by field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from rl_lightning.models.policy import DType


def _refuse(group: str, checks: dict[str, bool], values: object) -> None:
    for name, ok in checks.items():
        if not ok:
            raise ValueError(f"RolloutDataModule: invalid data.init_args.{group}.{name}="
                             f"{getattr(values, name)!r}")


@dataclass(frozen=True)
class Sampling:
    """How training rollouts are sampled.

    Args:
        max_new_tokens: the generation limit per response (per turn in multi-turn episodes); a response without EOS
            by then is marked ``truncated``.
        temperature: the sampling temperature (> 0).
        top_p: the nucleus sampling mass, in ``(0, 1]``.
        sync_interval: 1 samples with the current policy; ``k > 1`` samples with a copy of the policy refreshed
            every ``k`` steps, so sampler and learner really differ in between.
        dtype: sample with a copy of the policy in this dtype (``bfloat16``: an inference engine's precision
            against an fp32 learner), refreshed every ``sync_interval`` steps; ``None`` samples in the policy's own
            dtype. ``train/sampler_logp_diff`` measures the mismatch each setting makes (docs/algorithms.md,
            "Sampler/learner mismatch").
    """

    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    sync_interval: int = 1
    dtype: DType | None = None

    def __post_init__(self) -> None:
        _refuse("sampling", {
            "max_new_tokens": self.max_new_tokens >= 1, "temperature": self.temperature > 0,
            "top_p": 0 < self.top_p <= 1, "sync_interval": self.sync_interval >= 1,
            "dtype": self.dtype is None or self.dtype in get_args(DType),
        }, self)


@dataclass(frozen=True)
class Recording:
    """What the sampler records per generated position of training rollouts, beside the sampled tokens. A method
    that needs a record refuses a configuration without it (``RLModule.require_data_setting``).

    Args:
        topk: the sampling distribution's top-k ids and their full-vocabulary log-probs
            (``RolloutBatch.record.topk_ids`` / ``topk_logprobs``; Score Centering).
        aux_draws: K extra draws from the sampling distribution, independent of the sampled token
            (``RolloutBatch.record.aux_ids``; StableReinforce). The sampled tokens do not change.
    """

    topk: int = 0
    aux_draws: int = 0

    def __post_init__(self) -> None:
        _refuse("record", {"topk": self.topk >= 0, "aux_draws": self.aux_draws >= 0}, self)


@dataclass(frozen=True)
class PromptFormat:
    """How a prompt's text becomes tokens (``rollout.encoding.PromptEncoder``).

    Args:
        add_bos: prepend the tokenizer's BOS token to every prompt (when it has one).
        use_chat_template: wrap each prompt as a user message with the tokenizer's chat template (needed by tasks
            whose prompts are chat messages).
    """

    add_bos: bool = True
    use_chat_template: bool = False


@dataclass(frozen=True)
class Evaluation:
    """Greedy held-out evaluation (``val/reward``).

    Args:
        batch_size: held-out prompts per validation batch (per device).
        num_prompts: evaluate only the first ``num_prompts`` prompts of the split (``None``: all).
        split: ``"test"`` (the task's ``heldout_prompts``, what studies report) or ``"validation"`` (its
            ``validation_prompts``, what settings are tuned on; a task without one is refused).
            docs/environments.md#splits.
    """

    batch_size: int = 256
    num_prompts: int | None = None
    split: Literal["test", "validation"] = "test"

    def __post_init__(self) -> None:
        _refuse("evaluation", {
            "batch_size": self.batch_size >= 1, "num_prompts": self.num_prompts is None or self.num_prompts >= 0,
            "split": self.split in ("test", "validation"),
        }, self)


@dataclass(frozen=True)
class AsyncRollout:
    """A background producer of training batches (``rollout.async_producer.RolloutProducer``; SAO's asynchronous
    sampling). Not bit-reproducible: thread timing decides which weights draw which batch.

    Args:
        queue: 0 generates each training batch when the learner needs it; ``k >= 1`` generates with a copy of the
            policy up to ``k`` batches ahead while the learner updates; the copy takes the learner's newest weights
            before each batch. Needs ``sampling.sync_interval: 1`` (the producer's copy is the lag).
        max_staleness: the learner never consumes a batch drawn more than this many policy versions (updates) ago;
            older ones are dropped (``dropped_batches``).
    """

    queue: int = 0
    max_staleness: int = 2

    def __post_init__(self) -> None:
        _refuse("async_rollout", {"queue": self.queue >= 0, "max_staleness": self.max_staleness >= 0}, self)


#: the data module's settings groups: argument name -> class
GROUPS: dict[str, type] = {"sampling": Sampling, "record": Recording, "prompt_format": PromptFormat,
                           "evaluation": Evaluation, "async_rollout": AsyncRollout}


def grouped(init_args: dict) -> dict:
    """A copy of a config's ``data.init_args`` mapping (read with ``yaml.safe_load``) with each settings group's
    mapping built into its dataclass, for constructing a ``RolloutDataModule`` in Python from a config file."""
    return {key: GROUPS[key](**value) if key in GROUPS and isinstance(value, dict) else value
            for key, value in init_args.items()}
