"""``ConstantRewardWarning``: say so, in one line, when the training reward has not moved for the first steps.

A chat model on a task whose verifier expects another answer format scores exactly 0 on every response, and the
run trains on nothing without a word (a sentence never equals ``"29"`` under ``ExactMatchReward``). When every
training response of the first ``steps`` steps got the same reward, this callback prints one line naming the
value, the reward function and the task's instruction (its ``instruction`` attribute, when it has one), so the
mismatch is seen at step ``steps``, not after the run. It checks once per run and never stops it. The CLI adds it
to every run.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info


class ConstantRewardWarning(Callback):
    """Warn once when the first ``steps`` training batches (this rank's) all had one and the same reward."""

    def __init__(self, steps: int = 5) -> None:
        if steps < 1:
            raise ValueError(f"ConstantRewardWarning: steps must be >= 1, got {steps}")
        self.steps = steps
        self.values: set[float] = set()
        self.seen = 0
        self.message: str | None = None  # the line printed, if any

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.seen >= self.steps or getattr(batch, "rewards", None) is None:
            return
        self.seen += 1
        self.values |= {float(v) for v in batch.rewards.detach().float().cpu().unique().tolist()}
        if self.seen == self.steps and len(self.values) == 1:
            value = next(iter(self.values))
            datamodule = getattr(trainer, "datamodule", None)
            reward = type(getattr(datamodule, "reward_fn", None)).__name__
            task = getattr(datamodule, "task", None)
            instruction = getattr(task, "instruction", None)
            said = f", instruction {instruction!r}" if instruction is not None else ", no instruction"
            self.message = (f"rl-lightning: warning: every training response of the first {self.steps} steps got "
                            f"reward {value:g}: nothing to learn from. Does the reward function ({reward}) read "
                            f"the answers this model writes ({type(task).__name__}{said})? RolloutSamples shows "
                            "some; data.init_args.reward_fn sets another verifier")
            rank_zero_info(self.message)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "values": sorted(self.values)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seen, self.values = int(state_dict.get("seen", 0)), set(state_dict.get("values", []))
