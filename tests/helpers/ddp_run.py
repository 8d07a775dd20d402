"""Run a method for two steps under 2-process CPU DDP (gloo) and dump what each rank saw and ended with.

Usage: python tests/helpers/ddp_run.py OUT_DIR [grpo|grpo-skip|grpo-aux|ppo-separate|spo]  (plain ``ddp`` relaunches
this script)

Per rank it writes ``rank{r}.json`` (prompts drawn, logged losses, final weights) and, for every step ``s``,
``step{s}_rank{r}.pt``: the rollout batch's tensors, the policy's weights before the update (rank 0 only)
and the DDP-averaged gradient that reached the optimiser. For ``grpo`` the loss aggregation is
``seq_mean_token_mean`` at step 0 and ``token_mean`` at step 1, and gradients are not clipped, so the test can
recompute each step's gradient in one process holding both ranks' rows. ``grpo-skip`` is ``grpo`` (unclipped,
the default aggregation) with ``micro_batch_size=2`` and every reward on rank 0 the same: rank 0 skips all its
rows while rank 1 forwards some, so the ranks must still agree on the number of backward passes. ``grpo-aux`` is
``grpo-skip``'s setting with GRPO's rewards and ``AUX_ROWS[rank]`` auxiliary rows per rank (1 and 3, micro-batches of
one row: the ranks pad to the same number of backward passes), and a callback that adds ``train/rank_value`` (the
rank) with ``add_step_metrics``; ``rank{r}.json`` holds its logged value. ``grpo-eval`` is GRPO with a held-out
evaluation before and after every step (15 held-out prompts: 8 on rank 0, 7 on rank 1, in batches of 4), logged by a
``CSVLogger`` into ``OUT_DIR/run/version_0`` (``metrics.csv``, ``eval_items.csv``). ``grpo-dynamic`` is GRPO with
dynamic sampling (``RewardSpread``, 3 rounds) where no group on rank 0 has a reward spread: both ranks must draw
every round. ``grpo-dynamic-turns`` is the same on guess-the-number episodes (up to 5 turns), where rank 0's filter
rejects every group; its rank files also hold each step's turn fields.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rl_lightning.algorithms import GRPO, PPO, SPO  # noqa: E402
from rl_lightning.envs.base import Prompt, RewardFunction  # noqa: E402
from rl_lightning.rollout import Evaluation, RewardSpread, Sampling, WeightedSampler  # noqa: E402
from rl_lightning.rollout.batch import RolloutBatch  # noqa: E402
from tests.conftest import tiny_datamodule  # noqa: E402

#: loss aggregation of the ``grpo`` run at each step (token_mean is where a per-rank count would be wrong)
GRPO_AGGREGATION = ("seq_mean_token_mean", "token_mean")
BATCH_TENSORS = ("input_ids", "attention_mask", "loss_mask", "sampler_logprobs", "rewards", "prompt_index",
                 "truncated")
TURN_TENSORS = ("index", "count", "rewards")  # of batch.turns, recorded as turns.<name>


class GradedMatch(RewardFunction):
    """A dense reward (right characters in place, minus a length penalty): groups almost never tie, so the
    advantages, and the gradients the test compares, are not zero."""

    def __call__(self, prompt: Prompt, response: str) -> float:
        got, want = response.strip(), (prompt.answer or "").strip()
        return sum(a == b for a, b in zip(got, want)) / max(len(want), 1) - 0.25 * abs(len(got) - len(want))


def batch_record(batch: RolloutBatch) -> dict[str, Any]:
    record: dict[str, Any] = {name: getattr(batch, name).detach().cpu().clone() for name in BATCH_TENSORS}
    if batch.turns is not None:
        record.update({f"turns.{name}": getattr(batch.turns, name).detach().cpu().clone() for name in TURN_TENSORS})
    record.update(prompt_length=batch.prompt_length, group_size=batch.group_size,
                  temperature=batch.temperature, top_p=batch.top_p)
    return record


class ConstantOnRankZero(GradedMatch):
    """``GradedMatch`` on every rank but 0, where every response gets 0.5 (each group there has no spread)."""

    def __call__(self, prompt: Prompt, response: str) -> float:
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
            return 0.5
        return super().__call__(prompt, response)


class RejectOnRankZero(RewardSpread):
    """``RewardSpread`` on every rank but 0, where no group is kept."""

    def keep(self, batch: RolloutBatch) -> torch.Tensor:
        kept = super().keep(batch)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
            return torch.zeros_like(kept)
        return kept


#: per rank, the ``(context, target)`` ids of the ``grpo-aux`` run's auxiliary rows; their loss is
#: ``AUX_COEF · token_mean(-log π(target | context))`` over both ranks' rows
AUX_ROWS = ([([1, 5, 6], [7])], [([1, 7], [6]), ([1, 8, 9], [8]), ([1, 5], [9])])
AUX_COEF = 0.1


class RankAux(GRPO):
    """GRPO plus ``AUX_ROWS[rank]`` auxiliary rows with an NLL of their own (``grpo-aux``)."""

    def auxiliary_rows(self, batch, adv):  # noqa: ANN001, ANN201
        from rl_lightning.algorithms import AuxiliaryRows, Summed
        from rl_lightning.algorithms.forward import sequences_batch
        from rl_lightning.algorithms.planning import rollout_weights
        from rl_lightning.functional import aggregate

        mine = AUX_ROWS[self.trainer.global_rank]
        rows = sequences_batch([c for c, _ in mine], [t for _, t in mine], None, self.tokenizer.pad_token_id, 1.0,
                               self.device)
        weights = rollout_weights(rows, "token_mean", self.ranks) * AUX_COEF

        def loss(rows, out, w):  # noqa: ANN001, ANN202
            term = aggregate(-out.logprobs, w)
            return term, {"train/aux_nll": Summed(term.detach())}
        return [AuxiliaryRows(rows, weights, loss)]


class RankValue(Callback):
    """Adds the rank as ``train/rank_value`` at the end of every step (logged as the mean over ranks: 0.5)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        pl_module.add_step_metrics({"train/rank_value": float(trainer.global_rank)})

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        out = Path(trainer.default_root_dir) / f"rank_value{trainer.global_rank}.json"
        out.write_text(json.dumps(float(trainer.callback_metrics["train/rank_value"])))


class Dump(Callback):
    def __init__(self, out: Path, aggregation: tuple[str, ...] | None = None) -> None:
        self.out = out
        self.aggregation = aggregation
        self.prompt_index: list[list[int]] = []
        self.prompt_ids: list[list[int]] = []
        self.loss: list[float] = []
        self.step: dict[str, Any] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if self.aggregation is not None:
            pl_module.loss_aggregation = self.aggregation[trainer.global_step]
        self.step = {
            "aggregation": pl_module.loss_aggregation,
            "batch": batch_record(batch),
            "state": ({k: v.detach().cpu().clone() for k, v in pl_module.policy.state_dict().items()}
                      if trainer.global_rank == 0 else None),
        }

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        # manual optimisation: called once per rollout here (1 iteration, 1 minibatch), after DDP's all-reduce
        self.step["grads"] = {n: p.grad.detach().cpu().clone() for n, p in pl_module.named_parameters()
                              if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.prompt_index.append(sorted(set(batch.prompt_index.tolist())))
        if batch.prompt_id is not None:
            self.prompt_ids.append(batch.prompt_id.tolist())
        self.loss.append(float(trainer.callback_metrics["train/loss"]))
        self.step["logged_loss"] = self.loss[-1]  # averaged over ranks by log_training_metrics
        self.step["logged_entropy"] = float(trainer.callback_metrics["train/entropy"])
        self.step["logged_skipped_rows"] = float(trainer.callback_metrics["train/skipped_rows"])
        torch.save(self.step, self.out / f"step{trainer.global_step - 1}_rank{trainer.global_rank}.pt")

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "prompt_index": self.prompt_index,
            "loss": self.loss,
            "param_sum": float(flat.double().sum()),
            "param_abs_sum": float(flat.double().abs().sum()),
            "params": flat.tolist()[:2000],
            "prompt_ids": self.prompt_ids,
        }
        record["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        record["extra_draws"] = getattr(trainer.datamodule, "extra_draws", None)
        if hasattr(pl_module, "tracker"):  # SPO: the per-prompt tracker, to compare across ranks
            record["tracker"] = sorted([uid, a, b] for uid, (a, b) in pl_module.tracker.items())
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    method = sys.argv[2] if len(sys.argv) > 2 else "grpo"
    optimizer = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    extra_callbacks: list[Callback] = []
    if method == "grpo":  # unclipped, so the gradient the optimiser sees is the raw DDP average
        module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=optimizer, max_grad_norm=None)
        dump = Dump(out, GRPO_AGGREGATION)
        data = tiny_datamodule(prompts_per_step=4, reward_fn=GradedMatch())
    elif method == "grpo-lora":  # LoRA adapters (configs/presets/lora.yaml): only they train and synchronise
        from rl_lightning.models.adapters import LoraSettings

        module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=optimizer, max_grad_norm=None,
                      lora=LoraSettings(rank=4, alpha=8.0))
        dump = Dump(out)
        data = tiny_datamodule(prompts_per_step=4, reward_fn=GradedMatch())
    elif method == "grpo-skip":  # rank 0: no row to forward; rank 1: up to 4 micro-batches of 2
        module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=optimizer, max_grad_norm=None,
                      micro_batch_size=2)
        dump = Dump(out)
        data = tiny_datamodule(prompts_per_step=4, reward_fn=ConstantOnRankZero())
    elif method == "grpo-aux":  # rank 0: 1 auxiliary micro-batch, rank 1: 3
        module = RankAux(model_name_or_path="embedded:arithmetic", optimizer=optimizer, max_grad_norm=None,
                         micro_batch_size=1)
        dump = Dump(out)
        data = tiny_datamodule(prompts_per_step=4, reward_fn=GradedMatch())
    elif method == "grpo-eval":  # per-item outcomes gathered over ranks
        from rl_lightning.envs import ArithmeticTask

        module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=optimizer)
        dump = Dump(out)
        data = tiny_datamodule(prompts_per_step=4, task=ArithmeticTask(num_heldout=15), batch_size=4)
    elif method == "grpo-dynamic":  # dynamic sampling: rank 0's groups never pass RewardSpread, rank 1's do
        module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=optimizer)
        dump = Dump(out)
        data = tiny_datamodule(prompts_per_step=4, reward_fn=ConstantOnRankZero(), group_filter=RewardSpread(),
                               max_rounds=3)
    elif method == "grpo-dynamic-turns":  # the same on multi-turn episodes: rank 0 keeps no group
        from rl_lightning.envs import GuessNumberTask
        from rl_lightning.rollout import GroupRollout, RolloutDataModule

        module = GRPO(model_name_or_path="embedded:guess", optimizer=optimizer)
        dump = Dump(out)
        data = RolloutDataModule(task=GuessNumberTask(), prompts_per_step=4, group_size=4,
                                 strategy=GroupRollout(max_turns=5, max_episode_tokens=32),
                                 group_filter=RejectOnRankZero(), max_rounds=3, seed=0,
                                 sampling=Sampling(max_new_tokens=3, temperature=1.5),
                                 evaluation=Evaluation(batch_size=8))
    elif method == "spo":  # a pool of 6 prompts, 4 per step: the ranks revisit each other's prompts
        module = SPO(model_name_or_path="embedded:arithmetic", optimizer=optimizer)
        dump = Dump(out)
        data = tiny_datamodule(prompts_per_step=4, group_size=1, prompt_sampler=WeightedSampler(pool_size=6))
    elif method in ("tempo", "ac2"):  # branches from saved states; TEMPO past its warm-up, AC2 with its audits
        from rl_lightning.algorithms import AC2, TEMPO
        from rl_lightning.callbacks import FullRolloutAudit
        from rl_lightning.envs import ArithmeticTask, GuessNumberTask
        from rl_lightning.rollout import BranchRollout, RolloutDataModule

        dump = Dump(out)
        if method == "tempo":
            module = TEMPO(model_name_or_path="embedded:guess", horizon=1, warmup_steps=1, replay=2,
                           optimizer=optimizer)
            data = RolloutDataModule(task=GuessNumberTask(), prompts_per_step=4, group_size=4,
                                     strategy=BranchRollout(n=4, max_turns=5, max_episode_tokens=32), seed=0,
                                     sampling=Sampling(max_new_tokens=3))
        else:
            module = AC2(model_name_or_path="embedded:arithmetic_hard", chunk_tokens=2, replay=2,
                         optimizer=optimizer)
            data = RolloutDataModule(task=ArithmeticTask(num_digits=3, num_heldout=8), prompts_per_step=4,
                                     group_size=4, strategy=BranchRollout(n=4, max_turns=1), seed=0,
                                     sampling=Sampling(max_new_tokens=6))
            extra_callbacks = [FullRolloutAudit(fraction=1.0)]
    else:  # every parameter of a separate critic must receive a gradient, or plain DDP refuses the step
        module = PPO(model_name_or_path="embedded:arithmetic", critic="separate", optimizer=optimizer)
        dump = Dump(out)
        data = tiny_datamodule(prompts_per_step=4)
    evaluation: dict[str, Any] = dict(logger=False, limit_val_batches=0)
    if method == "grpo-eval":
        from lightning.pytorch.loggers import CSVLogger

        evaluation = dict(logger=CSVLogger(str(out), name="run", version=0), limit_val_batches=1.0,
                          val_check_interval=1, check_val_every_n_epoch=None)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps={"spo": 3, "tempo": 4, "ac2": 4}.get(method, 2),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(out), **evaluation,
        callbacks=[dump] + ([RankValue()] if method == "grpo-aux" else []) + extra_callbacks,
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
