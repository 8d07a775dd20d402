"""``RolloutProducer``: asynchronous rollouts (SAO's asynchronous sampling, Hou et al. 2026, arXiv 2607.07508:
training need not wait for the trajectories).

A background thread generates training batches on the rollout engine, with weights of its own (for the
in-process engines a copy of the policy; the ``SamplerSync`` owns them), into a bounded queue while the learner
updates. Each batch is stamped with the *policy version* that drew it -- the number of updates (``global_step``)
the weights it sampled with had seen. The learner publishes its weights each time it takes a batch (``take``),
and the producer loads the newest published weights before each generation, so a batch is
at most a few versions behind the learner; ``max_staleness`` bounds that: a batch older than the bound when the
learner would consume it is dropped (``dropped`` counts them) and the next one taken, so the learner never
trains on a trajectory more than ``max_staleness`` versions old.

Nothing is lost or duplicated across a checkpoint: ``state_dict`` snapshots the queued batches and the stream
step the producer generates next (a batch being generated at that moment is not in the queue and its step is
not yet passed, so a resumed producer generates it again); ``load_state_dict`` puts them back, and the resumed
learner consumes the saved batches first. Which version draws which batch depends on thread timing, so an
asynchronous run is not bit-reproducible (a synchronous one is); each batch's own sampling is still seeded by its
stream step (its auxiliary draws too), so a batch is the synchronous batch of its step drawn with the same weights.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
from torch import nn

from rl_lightning.envs.base import Prompt
from rl_lightning.rollout.batch import EndState, EpisodeEnds, RolloutBatch, SamplerRecord, Turns
from rl_lightning.rollout.engine import RolloutEngine
from rl_lightning.rollout.sync import SamplerSync

#: the fields of ``Turns`` and their names as fields of the batch, in checkpoints written before it was a group
_FLAT_TURNS = {"obs_mask": "obs_mask", "index": "turn_index", "count": "num_turns", "rewards": "turn_rewards"}


@dataclass
class Produced:
    """One queued batch: the stream ``step`` it answers, the policy ``version`` that drew it, the rollout."""

    step: int
    version: int
    batch: RolloutBatch


class RolloutProducer:
    """A background generator of training batches into a bounded queue (see the module docstring).

    Args:
        generate: ``(engine, step) -> RolloutBatch``: the data module's rollout of stream step ``step`` on
            ``engine`` (called on the producer's thread, under ``torch.no_grad``).
        sync: the sampler sync that owns the producer's weights (``publish`` on the learner's side, ``refresh``
            on the producer's); its engine is set up already, with the version its weights have.
        capacity: queue size (>= 1): how many batches the producer may run ahead.
        max_staleness: the largest ``learner version - batch version`` consumed (>= 0).
        start_step: the first stream step to generate.
    """

    def __init__(self, generate: Callable[[RolloutEngine, int], RolloutBatch], sync: SamplerSync, capacity: int,
                 max_staleness: int, start_step: int = 0) -> None:
        if capacity < 1 or max_staleness < 0:
            raise ValueError(f"RolloutProducer: need capacity >= 1 and max_staleness >= 0, got {capacity}, "
                             f"{max_staleness}")
        self.generate = generate
        self.capacity, self.max_staleness = capacity, max_staleness
        self.sync = sync
        self.items: deque[Produced] = deque()
        self.next_step = start_step
        self.dropped = 0
        self.last_taken: Produced | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ learner side
    def publish(self, policy: nn.Module, version: int) -> None:
        """Offer the learner's current weights (after ``version`` updates) to the producer."""
        self.sync.publish(policy, version)

    def take(self, version: int) -> Produced:
        """The next queued batch at most ``max_staleness`` versions older than ``version`` (older ones are
        dropped); blocks until there is one. Starts the thread on first use; re-raises a producer failure."""
        self.start()
        with self._cond:
            while True:
                while not self.items and self._error is None:
                    self._cond.wait(timeout=1.0)
                if self._error is not None:
                    raise RuntimeError(f"the rollout producer failed: {self._error}") from self._error
                item = self.items.popleft()
                self._cond.notify_all()
                if version - item.version <= self.max_staleness:
                    self.last_taken = item
                    return item
                self.dropped += 1

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rl-lightning-rollout-producer", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread (the batch it is generating is discarded: its step is generated again on resume)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ checkpointing
    @staticmethod
    def _pack(batch: RolloutBatch) -> dict[str, Any]:
        """``batch`` as tensors and plain values only (a checkpoint loads with ``weights_only=True``)."""
        state = {f.name: getattr(batch, f.name) for f in fields(batch)}
        state["prompts"] = [p.to_state() for p in batch.prompts]
        state["record"] = {k: v.to("cpu") for k, v in batch.record.tensors().items()}
        if batch.turns is not None:
            state["turns"] = {k: v.to("cpu") for k, v in batch.turns.tensors().items()}
        if batch.ends is not None:
            state["ends"] = {"terminated": batch.ends.terminated.to("cpu"),
                             "states": [None if e is None else e.to_state() for e in batch.ends.states]}
        return {k: (v.to("cpu") if isinstance(v, torch.Tensor) else v) for k, v in state.items()}

    @staticmethod
    def _unpack(state: dict[str, Any], device: torch.device | str) -> RolloutBatch:
        values = dict(state, prompts=[Prompt.from_state(p) for p in state["prompts"]])
        # a checkpoint written before the record, the turns and the ends were groups holds their parts as fields of
        # the batch (the turns' as obs_mask, turn_index, num_turns and turn_rewards)
        record = {**values.pop("record", {}),
                  **{f.name: values.pop(f.name) for f in fields(SamplerRecord) if f.name in values}}
        values["record"] = SamplerRecord(**{k: v for k, v in record.items() if v is not None})
        turns = values.pop("turns", None)
        flat = {name: values.pop(old) for name, old in _FLAT_TURNS.items() if old in values}
        if turns is None and any(v is not None for v in flat.values()):
            turns = flat
        if turns is not None:
            values["turns"] = Turns(**turns)
        ends = values.pop("ends", None)
        terminated, states = values.pop("terminated", None), values.pop("end_states", None)
        if ends is None and terminated is not None and states is not None:
            ends = {"terminated": terminated, "states": states}
        if ends is not None:
            values["ends"] = EpisodeEnds(ends["terminated"],
                                         [None if e is None else EndState.from_state(e) for e in ends["states"]])
        return RolloutBatch(**values).to(device)

    def state_dict(self, include_last_taken: bool = False) -> dict[str, Any]:
        """The queued batches (on the CPU), the next step to generate and ``dropped``; with ``include_last_taken``
        (a checkpoint in the middle of a step, whose update has not completed) the batch the learner took last
        first, so the resumed run trains on it again rather than losing it."""
        with self._cond:
            items = [self.last_taken] if include_last_taken and self.last_taken is not None else []
            return {"items": [(i.step, i.version, self._pack(i.batch)) for i in [*items, *self.items]],
                    "next_step": self.next_step, "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str) -> None:
        with self._cond:
            self.items = deque(Produced(s, v, self._unpack(b, device)) for s, v, b in state["items"])
            self.next_step = int(state["next_step"])
            self.dropped = int(state["dropped"])

    # ------------------------------------------------------------------ producer side
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while len(self.items) >= self.capacity and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    self.sync.refresh()  # the newest published weights, if newer
                    step, version = self.next_step, self.sync.version
                with torch.no_grad():
                    batch = self.generate(self.sync.engine, step)  # outside the lock: the learner runs meanwhile
                with self._cond:
                    if self._stop:
                        return
                    self.items.append(Produced(step, version, batch))
                    self.next_step = step + 1
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 -- handed to the learner, which raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()
