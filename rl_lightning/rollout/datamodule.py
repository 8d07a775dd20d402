"""``RolloutDataModule``: prompts from a seeded, rank-sharded stream, turned into rollouts on the device.

The training loader yields a ``StepRequest`` per step (the held-out loader ``PromptBatch`` objects). Right after
Lightning moves one to the device (``on_after_batch_transfer``, i.e. just before ``training_step``), the data
module draws the step's prompts, generates ``group_size`` responses per prompt with the *sampler*, scores them,
and hands the algorithm a ``RolloutBatch``: the one hand-over from data to step. Generation
therefore lives here, serves every method alike, and never runs ahead of the update that precedes it.

The module it trains must expose ``policy`` (a Hugging Face causal LM) and ``tokenizer`` attributes; ``setup``
reads them once (``bind``). The rollout flows one way from there: the data module readies the engine with the
weights a batch samples with (``rollout.sync.SamplerSync``: the policy itself, a lagged or low-precision copy, or
the asynchronous producer's) and hands the strategy a ``RolloutContext`` -- it never hands over itself.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from rl_lightning.functional.errors import ConfigError
from rl_lightning.envs.base import Prompt, RewardFunction, Task
from rl_lightning.rollout.async_producer import Produced, RolloutProducer
from rl_lightning.rollout.batch import PromptBatch, RolloutBatch, StepRequest
from rl_lightning.rollout.branching import Branch, BranchRollout
from rl_lightning.rollout.encoding import PromptEncoder
from rl_lightning.rollout.engine import AUX_DRAWS, TOPK, RolloutEngine, SamplingParams, check_capabilities
from rl_lightning.rollout.engines import KVCacheEngine
from rl_lightning.rollout.filters import GroupFilter, group_rows
from rl_lightning.rollout.inputs import DeclaresRolloutInputs, RolloutInputs
from rl_lightning.rollout.prompts import PromptSampler, SequentialSampler, WeightedSampler
from rl_lightning.rollout.settings import AsyncRollout, Evaluation, PromptFormat, Recording, Sampling
from rl_lightning.rollout.shaping import RewardShaper
from rl_lightning.rollout.strategies import GroupRollout, RolloutContext, RolloutStrategy
from rl_lightning.rollout.sync import SamplerSync


class _TrainStream(IterableDataset):
    """Endless ``StepRequest``s starting at the data module's cursor (so a resumed run continues the stream)."""

    def __init__(self, datamodule: RolloutDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[StepRequest]:
        step = self.datamodule.cursor
        while True:  # the prompts are drawn when the step's rollout starts (the loader prefetches a step ahead)
            yield StepRequest(step)
            step += 1


class _HeldoutBatches(IterableDataset):
    """This rank's held-out prompt batches, every one of them. An iterable, so Lightning never shards it again with
    a distributed sampler: the prompts are already split between ranks (``val_prompt_batches``), and a sampler over
    the batch list would give each rank only some of its own batches."""

    def __init__(self, batches: list[PromptBatch]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[PromptBatch]:
        return iter(self.batches)


class RolloutDataModule(LightningDataModule):
    """Generates on-device rollout batches each step for any algorithm.

    Args:
        task: where prompts, held-out prompts and the default verifier come from.
        prompts_per_step: prompts per training step over all devices (must divide by the world size).
        group_size: responses sampled per prompt (``G``).
        sampling: how training rollouts are sampled (``Sampling``: ``max_new_tokens``, ``temperature``, ``top_p``,
            and the sampler's weights: ``sync_interval``, ``dtype``); held-out evaluation uses the same
            ``max_new_tokens``, greedily.
        reward_fn: reward function; ``None`` uses the task's verifier (exact match by default).
        evaluation: greedy held-out evaluation (``Evaluation``: ``batch_size``, ``num_prompts``, ``split``: the
            ``test`` split studies report or the ``validation`` split settings are tuned on).
        prompt_format: how prompts are encoded (``PromptFormat``: ``add_bos``, ``use_chat_template``).
        seed: seeds sampling; step ``k`` on rank ``r`` draws from a generator seeded by ``(seed, r, k)``.
        engine: the sampling engine (``None``: ``KVCacheEngine``, the library's KV-cache loop;
            ``HFGenerateEngine`` uses Hugging Face ``generate`` as a reference). Its declared capabilities are
            checked against what the configuration asks for at ``setup`` (``rollout.engine``).
        strategy: how prompts become rollouts (``None``: ``GroupRollout()``: ``group_size`` single-turn
            episodes per prompt; ``GroupRollout(max_turns=k)`` for multi-turn environments). See
            ``rl_lightning.rollout.strategies``.
        prompt_sampler: which stream indices a step draws (``None``: ``SequentialSampler()``, the seeded stream in
            order; ``WeightedSampler`` draws from a pool by weights a method sets). See
            ``rl_lightning.rollout.prompts``.
        record: what the sampler records beside the sampled tokens (``Recording``: ``topk`` ids and log-probs for
            Score Centering, ``aux_draws`` for StableReinforce).
        async_rollout: a background producer of training batches (``AsyncRollout``: ``queue``, ``max_staleness``;
            SAO's asynchronous sampling); ``queue: 0`` (the default) generates each batch when the learner needs it.
        group_filter: dynamic sampling (``rollout.filters``; DAPO's with ``RewardSpread``): a training step keeps
            the prompt groups this filter accepts and draws the prompt stream's next prompts for more, up to
            ``max_rounds`` rollouts in all, until every rank holds ``prompts_per_step / W`` accepted groups; each
            rank then keeps exactly that many (accepted ones first, topped up with rejected ones when the rounds
            ran out), so every rank trains on equal rows. Every sampled token counts in ``perf/sampled_tokens``;
            logged: ``train/prefilter_reward``, ``train/sampling_rounds``, ``train/kept_group_fraction``.
        max_rounds: the most rollouts one training step draws with a ``group_filter`` (1: filter nothing away,
            only reorder).
        reward_shapers: terms added to every training batch's rewards after the task's verifier (and after
            ``group_filter`` chose the groups on the task's reward), e.g. DAPO's ``OverlongPenalty``
            (``rollout.shaping``); held-out evaluation is never shaped. Logged: ``train/task_reward`` and each
            shaper's mean term.
    """

    def __init__(
        self,
        task: Task,
        prompts_per_step: int = 16,
        group_size: int = 8,
        sampling: Sampling = Sampling(),
        reward_fn: RewardFunction | None = None,
        evaluation: Evaluation = Evaluation(),
        prompt_format: PromptFormat = PromptFormat(),
        seed: int = 0,
        engine: RolloutEngine | None = None,
        strategy: RolloutStrategy | None = None,
        prompt_sampler: PromptSampler | None = None,
        record: Recording = Recording(),
        async_rollout: AsyncRollout = AsyncRollout(),
        group_filter: GroupFilter | None = None,
        max_rounds: int = 1,
        reward_shapers: list[RewardShaper] | None = None,
    ) -> None:
        super().__init__()
        checks = {"prompts_per_step": prompts_per_step >= 1, "group_size": group_size >= 1,
                  "max_rounds": max_rounds >= 1}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"RolloutDataModule: invalid data.init_args.{name}={locals()[name]!r}")
        self.task = task
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.sampling, self.evaluation, self.prompt_format = sampling, evaluation, prompt_format
        self.record, self.async_rollout = record, async_rollout
        self.reward_fn = reward_fn if reward_fn is not None else task.default_reward()
        if task.needs_chat_template() and not prompt_format.use_chat_template:
            raise ConfigError(f"data.init_args.prompt_format.use_chat_template=false, but {type(task).__name__}'s "
                              f"prompts are chat messages (a system prompt or a messages column) that only the chat "
                              f"template renders: set data.init_args.prompt_format.use_chat_template true")
        self.seed = seed
        self.engine = engine if engine is not None else KVCacheEngine()
        self.strategy = strategy if strategy is not None else GroupRollout()
        owned = self.strategy.group_size
        if owned is not None and owned != group_size:
            raise ValueError(f"RolloutDataModule: data.init_args.group_size={group_size} differs from "
                             f"data.init_args.strategy.init_args.n={owned} ({type(self.strategy).__name__}'s rows per "
                             "branch, the batch's group size); set them equal")
        self.prompt_sampler = prompt_sampler if prompt_sampler is not None else SequentialSampler()
        if async_rollout.queue and sampling.sync_interval != 1:
            raise ValueError(f"RolloutDataModule: data.init_args.async_rollout.queue={async_rollout.queue} needs "
                             f"data.init_args.sampling.sync_interval=1 (the producer's copy of the policy is the lag), "
                             f"got {sampling.sync_interval}")
        if group_filter is not None and async_rollout.queue:
            raise ValueError("RolloutDataModule: group_filter (dynamic sampling) is not supported with "
                             "async_rollout.queue; set one of them")
        self.group_filter, self.max_rounds = group_filter, max_rounds
        self.extra_draws = 0  # prompt draws beyond one per step so far (dynamic sampling's refills)
        self._extra_draws_at_step = 0  # ... when the current step's rollout began (what a mid-step checkpoint saves)
        self._step_metrics: dict[str, Tensor] = {}
        self.step_started: float | None = None  # perf_counter() when the running training step's rollout began
        self.reward_shapers = list(reward_shapers or [])
        for shaper in self.reward_shapers:
            shaper.bind(self)
        self.sync = SamplerSync(self.engine, sampling.sync_interval, sampling.dtype,
                                asynchronous=async_rollout.queue > 0)
        self._producer: RolloutProducer | None = None
        self._pending_producer: dict[str, Any] | None = None
        self.cursor = 0  # training steps drawn so far (the stream position)
        self._policy: nn.Module | None = None
        self._encoder: PromptEncoder | None = None
        self._injected: list[RolloutBatch] = []
        self._sampled_tokens = 0  # tokens sampled for training since take_sampled_tokens (perf/sampled_tokens)
        #: the last rollout a reward function raised in (responses, rewards scored so far), for FailureDump
        self.failed_rollout: RolloutBatch | None = None

    # ------------------------------------------------------------------ the learner's side
    def bind(self, policy: nn.Module, tokenizer: Any) -> None:
        """Roll out for the learner's ``policy`` with ``tokenizer`` (``setup`` binds the trained module's); the
        engine's capabilities are checked against this configuration here."""
        check_capabilities(self.engine, self.needs())
        self._policy = policy
        self._encoder = PromptEncoder(tokenizer, self.prompt_format.add_bos, self.prompt_format.use_chat_template)

    def needs(self) -> dict[str, str]:
        """The engine capabilities this configuration needs, each with the setting that asks for it."""
        needs = dict(self.strategy.needs())
        if self.record.topk:
            needs[TOPK] = f"record.topk={self.record.topk}"
        if self.record.aux_draws:
            needs[AUX_DRAWS] = f"record.aux_draws={self.record.aux_draws}"
        return needs

    def take_inputs(self, inputs: RolloutInputs, owner: str = "the method") -> None:
        """Serve a module's declared ``RolloutInputs``: its branches to the ``BranchRollout`` strategy, its prompt
        weights to the ``WeightedSampler``; a configuration that cannot serve one is refused, naming the field."""
        if inputs.branches is not None:
            if not isinstance(self.strategy, BranchRollout):
                raise ConfigError(f"{owner} sets where its rollouts start (rollout_inputs().branches): "
                                  f"data.init_args.strategy must be a rl_lightning.rollout.BranchRollout, got "
                                  f"{type(self.strategy).__name__}")
            self.strategy.branches_from(inputs.branches)
        if inputs.prompt_weights is not None:
            if not isinstance(self.prompt_sampler, WeightedSampler):
                raise ConfigError(f"{owner} weights the prompts it draws (rollout_inputs().prompt_weights): "
                                  f"data.init_args.prompt_sampler must be a rl_lightning.rollout.WeightedSampler, "
                                  f"got {type(self.prompt_sampler).__name__}")
            self.prompt_sampler.weights_from(inputs.prompt_weights)

    def _bind_trained_module(self, required: bool) -> None:
        """``bind`` the trained module's policy and tokenizer and serve its declared ``rollout_inputs()``
        (``take_inputs``) -- the one place the data module reads its module."""
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        if module is not None and hasattr(module, "policy") and hasattr(module, "tokenizer"):
            self.bind(module.policy, module.tokenizer)
            if isinstance(module, DeclaresRolloutInputs):
                self.take_inputs(module.rollout_inputs(), type(module).__name__)
        elif required:
            raise RuntimeError("RolloutDataModule needs a LightningModule with `policy` and `tokenizer` attributes")

    def _learner(self) -> tuple[nn.Module, PromptEncoder]:
        """The bound policy and encoder (bound at the first rollout of a data module driven without a fit)."""
        if self._policy is None:
            self._bind_trained_module(required=True)
        return self._policy, self._encoder

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _version(self) -> int:
        """The learner's policy version: the updates it has made."""
        return int(getattr(self.trainer, "global_step", 0) or 0)

    def setup(self, stage: str) -> None:
        rank, world = self._world()
        if self.prompts_per_step % world:
            raise ValueError(
                f"RolloutDataModule: prompts_per_step={self.prompts_per_step} must be divisible by the "
                f"number of devices ({world})"
            )
        self._bind_trained_module(required=False)

    # ------------------------------------------------------------------ prompts
    def prompt_batch(self, step: int) -> PromptBatch:
        """The prompts this rank trains on at ``step``: its contiguous slice of the step's global indices, which
        the ``prompt_sampler`` chooses (the same on every rank)."""
        rank, world = self._world()
        per_rank = self.prompts_per_step // world
        chosen = self.prompt_sampler.indices(self.task, step, self.prompts_per_step, self.seed)
        if len(chosen) != self.prompts_per_step:
            raise ValueError(f"{type(self.prompt_sampler).__name__} returned {len(chosen)} indices for step {step}, "
                             f"expected prompts_per_step={self.prompts_per_step}")
        indices = chosen[rank * per_rank:(rank + 1) * per_rank]
        return PromptBatch("train", step, indices, [self.task.train_prompt(i) for i in indices])

    def heldout_prompts(self) -> list[Prompt]:
        """The evaluated prompts: the task's ``evaluation.split`` (its first ``evaluation.num_prompts`` when set)."""
        if self.evaluation.split == "test":
            prompts = self.task.heldout_prompts()
        else:
            try:
                prompts = self.task.validation_prompts()
            except NotImplementedError as err:
                raise ValueError(f"data.init_args.evaluation.split='validation': {err} "
                                 "(docs/environments.md#splits)") from None
        limit = self.evaluation.num_prompts
        return prompts if limit is None else prompts[:limit]

    def val_prompt_batches(self) -> list[PromptBatch]:
        """This rank's share of the held-out prompts, in batches of ``evaluation.batch_size``."""
        rank, world = self._world()
        prompts, size = self.heldout_prompts(), self.evaluation.batch_size
        mine = list(range(rank, len(prompts), world))
        return [PromptBatch("val", -1, mine[k:k + size], [prompts[i] for i in mine[k:k + size]])
                for k in range(0, len(mine), size)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_TrainStream(self), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_HeldoutBatches(self.val_prompt_batches()), batch_size=None, num_workers=0,
                          collate_fn=lambda b: b)

    # ------------------------------------------------------------------ rollouts
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """The hand-over to the step: Lightning passes each item of the loaders here, on the device, right before
        ``training_step`` (or the validation step), and it becomes the ``RolloutBatch`` the step receives: a
        training ``StepRequest`` (whose start is noted first: ``step_started``, from which ``perf/step_time``
        counts) or a held-out ``PromptBatch``."""
        if isinstance(batch, StepRequest):
            self.step_started = time.perf_counter()
        if isinstance(batch, (StepRequest, PromptBatch)):
            return self.rollout(batch)
        return batch

    @property
    def tokenizer(self) -> Any:
        """The trained module's tokenizer."""
        return self._learner()[1].tokenizer

    def sampling_params(self, batch: PromptBatch) -> SamplingParams:
        """The sampling settings of ``batch``: a training batch's draws (and its auxiliary draws) seeded by
        ``(seed, rank, step)``, so an asynchronous batch is the synchronous batch of its step, and every rank
        resumes its own stream with no state to checkpoint; a held-out batch greedy."""
        if batch.split != "train":
            return self._params(greedy=True)
        rank, _ = self._world()
        seed = (self.seed * 1_000_003 + rank) * 1_000_033 + batch.step
        return self._params(seed=seed, topk=self.record.topk, aux_draws=self.record.aux_draws,
                            aux_seed=seed * 31 + 7 if self.record.aux_draws else None)

    def _params(self, **extra: Any) -> SamplingParams:
        """``SamplingParams`` of the ``sampling`` settings and the tokenizer's EOS and pad ids, plus ``extra``."""
        tok, s = self.tokenizer, self.sampling
        return SamplingParams(max_tokens=s.max_new_tokens, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, temperature=s.temperature, top_p=s.top_p, **extra)

    def context(self, engine: RolloutEngine, batch: PromptBatch, device: torch.device) -> RolloutContext:
        """What the strategy makes ``batch``'s rollout with; a new rollout starts, so ``failed_rollout`` is
        forgotten (the context's ``keep_failed`` sets it again if a reward function raises in this one)."""
        rank, world = self._world()
        self.failed_rollout = None
        return RolloutContext(self._learner()[1], engine, self.task, self.reward_fn, self.sampling_params(batch),
                              self.group_size, self.seed, device, rank, world, keep_failed=self._keep_failed)

    def _keep_failed(self, batch: RolloutBatch) -> None:
        self.failed_rollout = batch

    def sampler(self) -> nn.Module | None:
        """The model that generates this step: the policy, or its copy (lagged: refreshed every
        ``sampling.sync_interval`` steps; in ``sampling.dtype``); ``None`` for an engine without a module."""
        return self.sync.model(self._learner()[0], self.cursor)

    def sample(self, prompts: list[Prompt], n: int) -> RolloutBatch:
        """``n`` scored responses to each of ``prompts`` (rows ``i*n .. i*n+n-1``) with the training sampling
        settings and the learner's current weights, outside the training stream (the cursor does not move; seeded
        by the data module's seed, a step of -1 and each prompt's position): pass@k evaluation and generation over
        a file (``rl-lightning generate``)."""
        if self.strategy.group_size is not None:
            raise ConfigError(f"{type(self.strategy).__name__} decides the samples per prompt itself; sample() needs "
                              f"the default strategy")
        policy, _ = self._learner()
        device = next(policy.parameters()).device
        batch = PromptBatch("train", -1, list(range(len(prompts))), list(prompts))
        context = replace(self.context(self.sync.current(policy, self._version()), batch, device), group_size=n)
        return self.strategy.rollout(context, batch)

    def rollout(self, batch: StepRequest | PromptBatch) -> RolloutBatch:
        """Generate and score responses on the policy's device: for a ``StepRequest`` the step's training rollout
        (its prompts drawn now, with the sampler's weights of this moment), or for ``batch``'s prompts."""
        policy, _ = self._learner()
        device = next(policy.parameters()).device
        train = isinstance(batch, StepRequest) or batch.split == "train"
        if train and batch.step != self.cursor:
            raise RuntimeError(f"prompt stream out of sync: batch for step {batch.step}, cursor at {self.cursor}")
        if train and self._injected:
            self.cursor += 1
            return self._counted(self._injected.pop(0).to(device))
        if train and self.async_rollout.queue:  # perf/rollout_time: how long the learner waited for it (0: none)
            self.cursor += 1
            start = time.perf_counter()
            produced = self._take_produced().batch.to(device)
            return self._counted(replace(produced, rollout_time=time.perf_counter() - start, reward_time=0.0))
        if isinstance(batch, StepRequest):
            self._extra_draws_at_step = self.extra_draws
            batch = self.prompt_batch(batch.step + self.extra_draws)  # the stream's next draw
        engine = self.sync.for_step(policy, self.cursor) if train else self.sync.current(policy, self._version())
        try:
            out = self.strategy.rollout(self.context(engine, batch, device), batch)
        except FloatingPointError as err:
            where = f"step {batch.step}" if train else f"validation after step {self._version()}"
            raise FloatingPointError(f"rollout at {where}: {err}") from err
        if train:
            self.cursor += 1
            self._counted(out)
            if self.group_filter is not None:
                out = self._filled(engine, out, batch.step, device)
            if self.reward_shapers:
                out = self._shaped(out)
        return out

    def _shaped(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch`` with every ``reward_shapers`` term added to its rewards (their means kept for the step's log)."""
        terms = {shaper.metric: shaper.term(batch) for shaper in self.reward_shapers}
        self._step_metrics["train/task_reward"] = batch.rewards.float().mean()
        self._step_metrics.update({name: term.float().mean() for name, term in terms.items()})
        return replace(batch, rewards=batch.rewards + sum(terms.values()))

    def _filled(self, engine: RolloutEngine, first: RolloutBatch, draw: int, device: torch.device) -> RolloutBatch:
        """Dynamic sampling: ``first`` and more rounds from the stream's next draws, until every rank has
        ``prompts_per_step / W`` groups the ``group_filter`` accepts (or ``max_rounds``); this rank's that many
        groups, accepted ones first (see ``group_filter``)."""
        want, g = self.prompts_per_step // self._world()[1], self.group_size
        rounds, keeps = [first], [self.group_filter.keep(first).bool()]
        while len(rounds) < self.max_rounds and self._fewest(sum(int(k.sum()) for k in keeps), device) < want:
            draw += 1
            more = self.prompt_batch(draw)
            rounds.append(self._counted(self.strategy.rollout(self.context(engine, more, device), more)))
            keeps.append(self.group_filter.keep(rounds[-1]).bool())
        self.extra_draws += len(rounds) - 1
        keep = torch.cat(keeps)  # [groups of every round], in draw order
        order = torch.cat([torch.nonzero(keep), torch.nonzero(~keep)]).squeeze(1)[:want]  # accepted ones first
        self._step_metrics = {**self._step_metrics,
                              "train/prefilter_reward": torch.cat([r.rewards for r in rounds]).float().mean(),
                              "train/sampling_rounds": torch.tensor(float(len(rounds))),
                              "train/kept_group_fraction": torch.tensor(float(keep.sum()) / keep.numel())}
        return RolloutBatch.concat(rounds, pad_id=self._pad_id()).select(group_rows(order, g))

    def _fewest(self, count: int, device: torch.device) -> int:
        """The smallest ``count`` over the ranks (every rank calls it equally often: the rounds stay in step)."""
        if self._world()[1] == 1 or not torch.distributed.is_initialized():
            return count
        value = torch.tensor(float(count), device=device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
        return int(value)

    def _pad_id(self) -> int:
        tokenizer = self._learner()[1].tokenizer
        pad = getattr(tokenizer, "pad_token_id", None)
        return int(pad if pad is not None else getattr(tokenizer, "eos_token_id", 0) or 0)

    def take_rollout_metrics(self) -> dict[str, Tensor]:
        """The last training rollout's dynamic-sampling and shaping metrics (none without a ``group_filter`` or
        ``reward_shapers``), once."""
        taken, self._step_metrics = self._step_metrics, {}
        return taken

    def _counted(self, batch: RolloutBatch) -> RolloutBatch:
        """Count ``batch``'s sampled tokens (its ``loss_mask``: a prefix or observation ids are not sampled)."""
        self._sampled_tokens += int(batch.loss_mask.sum())
        return batch

    def take_sampled_tokens(self) -> int:
        """The tokens this rank sampled for training since the last call -- the training rollouts and every
        ``rollout_branches`` call (completions, audits), not held-out evaluation -- and start counting again:
        ``perf/sampled_tokens`` of each step, a study's compute axis (``experiments/report.py`` plots against it)."""
        taken, self._sampled_tokens = self._sampled_tokens, 0
        return taken

    def _generate(self, engine: RolloutEngine, step: int) -> RolloutBatch:
        """Stream step ``step``'s training rollout on ``engine`` (the asynchronous producer's work)."""
        batch = self.prompt_batch(step)
        return self.strategy.rollout(self.context(engine, batch, engine.device), batch)

    def _take_produced(self) -> Produced:
        """Publish the learner's weights and take the producer's next batch (the producer starts on first use)."""
        policy, _ = self._learner()
        version = self._version()
        if self._producer is None:
            pending, self._pending_producer = self._pending_producer, None
            self.sync.start(policy, version)
            self._producer = RolloutProducer(self._generate, self.sync, self.async_rollout.queue,
                                             self.async_rollout.max_staleness,
                                             start_step=0 if pending else self.cursor - 1)
            if pending is not None:
                self._producer.load_state_dict(pending, next(policy.parameters()).device)
        else:
            self._producer.publish(policy, version)
        return self._producer.take(version)

    @property
    def dropped_batches(self) -> int:
        """Asynchronous batches dropped as older than ``async_rollout.max_staleness`` (0 without a producer)."""
        return 0 if self._producer is None else self._producer.dropped

    def teardown(self, stage: str) -> None:
        if self._producer is not None:  # the batch in generation is dropped; its step is generated again on resume
            self._producer.stop()
        self.engine.close()

    def inject(self, batch: RolloutBatch) -> None:
        """Train the next step on ``batch`` instead of generating one (``rl-lightning replay`` uses it).

        The stream still advances by one step, so the step after it draws the prompts it would have drawn.
        """
        self._injected.append(batch)

    @torch.no_grad()
    def rollout_branches(self, branches: list[Branch], n: int = 1, seed: int | None = None,
                         greedy: bool = False, sampler: bool = False) -> RolloutBatch:
        """One-off rollouts from ``branches`` outside the training stream -- completions, audits: ``n``
        continuations of each (``BranchRollout.continue_from``: each branch's own horizon and token budget), the
        policy in eval mode, no gradient. The weights are the learner's current ones (``SamplerSync.current``, as
        held-out rollouts: for an engine outside the process that loads them into it), or with ``sampler`` those
        the last training rollout sampled with (a lagged or low-precision copy; not with an ``async_rollout``
        queue). The strategy's turn settings are the training strategy's (``max_turns``, ``max_turn_tokens``,
        ``max_episode_tokens``, ``stop_strings``, ``env_errors``); sampling is this module's ``sampling`` settings
        (``greedy``: the argmax), seeded by ``seed`` (default: from the data seed, the rank and the
        stream step), so the same call draws the same rows. The prompt stream does not move. A ``RolloutBatch``
        of ``len(branches) * n`` rows (``group_size = n``), on the policy's device."""
        if not branches:
            raise ValueError("RolloutDataModule.rollout_branches: no branches")
        if sampler and self.async_rollout.queue:
            raise ValueError("RolloutDataModule.rollout_branches: sampler=True needs async_rollout.queue=0 (the "
                             "producer's weights move on while the learner trains)")
        policy, encoder = self._learner()
        device = next(policy.parameters()).device
        plan = self.strategy if isinstance(self.strategy, GroupRollout) else GroupRollout()
        strategy = BranchRollout(n=n, max_turns=plan.max_turns, max_turn_tokens=plan.max_turn_tokens,
                                 max_episode_tokens=plan.max_episode_tokens, stop_strings=plan.stop_strings,
                                 env_errors=plan.env_errors, carry_cache=plan.carry_cache)
        rank, _ = self._world()
        seed = ((self.seed * 1_000_003 + rank) * 1_000_033 + self.cursor) * 7 + 5 if seed is None else seed
        params = self._params(greedy=greedy, seed=None if greedy else seed)
        engine = (self.sync.for_step(policy, max(self.cursor - 1, 0)) if sampler
                  else self.sync.current(policy, self._version()))
        ctx = RolloutContext(encoder, engine, self.task, self.reward_fn, params, n, self.seed, device)
        was_training = policy.training
        policy.eval()
        try:
            return self._counted(strategy.continue_from(ctx, branches, step=seed % 2**31))  # env seeds stay small
        finally:
            policy.train(was_training)

    @torch.no_grad()
    def evaluate(self, on_batch: Callable[[RolloutBatch], None] | None = None) -> tuple[float, int]:
        """Greedy held-out evaluation outside Lightning's loop: ``(sum of rewards, count)`` on this rank;
        ``on_batch`` sees each held-out ``RolloutBatch`` (the evaluation callback keeps the first for its observers)."""
        total, count = 0.0, 0
        for prompt_batch in self.val_prompt_batches():
            rollout = self.rollout(prompt_batch)
            if on_batch is not None:
                on_batch(rollout)
            total += float(rollout.rewards.sum())
            count += rollout.num_rows
        return total, count

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The stream position and the lagged sampler.

        The position saved is the number of rollout batches whose update has completed: a checkpoint written
        in the middle of a step (an interrupt, a failure dump) has drawn that step's prompts already, and
        resuming from it draws them again.
        """
        cursor = self.cursor
        trainer = self.trainer
        state = getattr(trainer, "state", None)
        if state is not None and state.fn == "fit" and hasattr(trainer, "global_step"):
            cursor = min(cursor, trainer.global_step)
        state: dict[str, Any] = {"cursor": cursor, **self.sync.state_dict()}
        if self.group_filter is not None:  # mid-step: the refills of the step being trained on are drawn again
            state["extra_draws"] = self.extra_draws if cursor == self.cursor else self._extra_draws_at_step
        if self._producer is not None:  # mid-step (cursor ahead of the updates done): keep the batch being trained on
            state["producer"] = self._producer.state_dict(include_last_taken=self.cursor > cursor)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.cursor = int(state_dict["cursor"])
        self.extra_draws = self._extra_draws_at_step = int(state_dict.get("extra_draws", 0))
        self.sync.load_state_dict(state_dict)
        self._pending_producer = state_dict.get("producer")
        if self._producer is not None:
            self._producer.stop()
            self._producer = None
        rank_zero_info(f"RolloutDataModule: resuming the prompt stream at step {self.cursor}")
