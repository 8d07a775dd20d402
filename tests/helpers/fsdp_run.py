"""Run GRPO for a few steps on 2 CPU processes (gloo) under FSDP2 or DDP and dump what each rank ended with.

Usage: python tests/helpers/fsdp_run.py OUT_DIR fsdp|ddp STEPS adam|sgd [RESUME_CKPT]
       (Lightning relaunches this script for the second rank)

FSDP2 is Lightning's ``ModelParallelStrategy`` (``data_parallel_size=2``): ``RLModule.configure_model`` shards the
policy one decoder layer at a time (``fully_shard``), generation samples with the full weights the sampler sync
gathers once per sync. Checkpoints are single files with the full state (``save_distributed_checkpoint=False``),
one per step under ``OUT_DIR/ckpt``. Per rank it writes ``rank{r}.pt``: the policy's full weights at the end and the
``train/grad_norm`` logged at every step. ``adam``: GRPO's AdamW with the gradient clipped (``max_grad_norm=0.05``,
below the norms the run sees, so the clip is active at every step); ``sgd``: plain SGD (``lr=1e-3``, no momentum,
no weight decay, no clip), so that a step moves the weights by exactly ``-lr`` times the gradient.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rl_lightning.algorithms import GRPO  # noqa: E402
from rl_lightning.callbacks import StepCheckpoint  # noqa: E402
from rl_lightning.models.sharding import full_state_dict  # noqa: E402
from tests.conftest import tiny_datamodule  # noqa: E402
from tests.helpers.ddp_run import GradedMatch  # noqa: E402


SGD_LR = 1e-3


class GradNorms(Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.norms.append(float(trainer.callback_metrics["train/grad_norm"]))


def main() -> None:
    out, kind, steps, opt = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    resume = sys.argv[5] if len(sys.argv) > 5 else None
    torch.manual_seed(0)
    torch.set_num_threads(1)
    settings = (dict(max_grad_norm=0.05) if opt == "adam" else
                dict(max_grad_norm=None, optimizer=lambda params: torch.optim.SGD(params, lr=SGD_LR)))
    module = GRPO(model_name_or_path="embedded:arithmetic", seed=0, **settings)
    dm = tiny_datamodule(reward_fn=GradedMatch(), prompts_per_step=4, group_size=4)
    strategy = (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False)
                if kind == "fsdp" else "ddp")
    norms = GradNorms()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, default_root_dir=str(out),
                      callbacks=[norms, StepCheckpoint(dirpath=out / "ckpt", every_n_train_steps=1, save_top_k=-1)])
    trainer.fit(module, datamodule=dm, ckpt_path=resume)
    weights = {k: v.detach().cpu().clone() for k, v in full_state_dict(module.policy).items()}
    torch.save({"weights": weights, "grad_norms": norms.norms, "step": trainer.global_step},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
