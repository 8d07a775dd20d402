"""What LoRA saves on a real model: peak memory with a KL reference, and the checkpoint's size.

Runs ``configs/grpo_smollm2.yaml`` for 2 steps with the KL penalty on (``beta 0.01``, reference model), once with
full fine-tuning (the reference is a second, frozen copy of the model) and once with ``configs/presets/lora.yaml``
(the reference is the base under the adapters: no copy), each in its own process, and prints each run's peak
resident memory (``ru_maxrss`` of the child) and the size of its ``last.ckpt``.

With ``--critics`` it runs the same 2 steps as PPO on the LoRA policy (the config's method switched to
``rl_lightning.algorithms.PPO``, the joint value loss), once with a critic network of its own (``critic separate``:
a second copy of the model, trained in full) and once with the critic's adapters on the policy's frozen base
(``critic adapter``: no copy).

    .venv/bin/python experiments/lora_memory.py [--model ~/.cache/rl_lightning/SmolLM2-135M-Instruct] [--critics]

Build the model first with ``.venv/bin/python experiments/smollm2.py``. Peak memory depends on the allocator and
on what else the process held; compare the two lines of one invocation, not figures of different machines.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(label: str, extra: list[str], model: str, root: Path) -> tuple[float, float]:
    """``(peak RSS GiB, last.ckpt GiB)`` of one 2-step fit in a fresh process."""
    code = (
        "import resource, subprocess, sys; "
        "rc = subprocess.call(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
    )
    command = [sys.executable, "-m", "rl_lightning", "fit", "--config", str(REPO / "configs" / "grpo_smollm2.yaml"),
               *extra, f"--model.init_args.model_name_or_path={model}", "--trainer.max_steps=2",
               "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
               "--trainer.callbacks+=KLRegularizer", "--trainer.callbacks.beta=0.01",
               f"--trainer.logger.init_args.save_dir={root / label}"]
    out = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    if out.returncode != 0:
        raise SystemExit(f"{label}: the fit failed:\n{out.stderr[-3000:]}")
    peak_kib = int(out.stdout.strip().splitlines()[-1])
    (ckpt,) = (root / label).rglob("last.ckpt")
    return peak_kib / 2**20, ckpt.stat().st_size / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(Path("~/.cache/rl_lightning/SmolLM2-135M-Instruct").expanduser()))
    parser.add_argument("--critics", action="store_true",
                        help="compare PPO's separate critic with its critic on adapters instead")
    args = parser.parse_args()
    lora = ["--config", str(REPO / "configs" / "presets" / "lora.yaml")]
    runs = [("full", []), ("lora", lora)]
    if args.critics:
        ppo = [*lora, "--model.class_path=rl_lightning.algorithms.PPO"]
        runs = [("ppo separate", [*ppo, "--model.init_args.critic=separate"]),
                ("ppo adapter", [*ppo, "--model.init_args.critic=adapter"])]
    method = "PPO (LoRA policy)" if args.critics else "GRPO"
    print(f"model {args.model}; 2 {method} steps of configs/grpo_smollm2.yaml, KL beta 0.01 to the reference; "
          f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in runs:
            peak, size = _run(label.replace(" ", "_"), extra, args.model, Path(tmp))
            print(f"{label:12s}  peak RSS {peak:6.2f} GiB   last.ckpt {size:6.3f} GiB", flush=True)


if __name__ == "__main__":
    main()
