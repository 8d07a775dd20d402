"""Run GRPO for two steps under 2-process CPU DDP (gloo) and dump what each rank saw and ended with.

Usage: python tests/helpers/ddp_run.py OUT_DIR [grpo|ppo-separate]   (plain ``ddp`` relaunches this script)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rl_lightning.algorithms import GRPO, PPO  # noqa: E402
from tests.conftest import tiny_datamodule  # noqa: E402


class Dump(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.prompt_index: list[list[int]] = []
        self.loss: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.prompt_index.append(sorted(set(batch.prompt_index.tolist())))
        self.loss.append(float(trainer.callback_metrics["train/loss"]))

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
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    method = sys.argv[2] if len(sys.argv) > 2 else "grpo"
    optimizer = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    if method == "grpo":
        module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=optimizer)
    else:  # every parameter of a separate critic must receive a gradient, or plain DDP refuses the step
        module = PPO(model_name_or_path="embedded:arithmetic", critic="separate", optimizer=optimizer)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=str(out), callbacks=[Dump(out)],
    )
    trainer.fit(module, datamodule=tiny_datamodule(prompts_per_step=4))


if __name__ == "__main__":
    main()
