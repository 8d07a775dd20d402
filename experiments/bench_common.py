"""What the TRL side-by-side benchmarks (``bench_vs_trl.py``, ``bench_vs_trl_realistic.py``) share.

Each benchmark keeps its workloads, its workers' measurements and its tables' columns. Here are the rest: the
command line (the workload choice, timed and warm-up steps, repeats, ``--json`` and the hidden worker options),
the worker subprocesses and their alternation, the timed training run of each framework with the settings both
benchmarks give it, the machine line and the Markdown tables.

The heavy imports (torch, trl, lightning, rl_lightning) happen inside the functions, in the worker subprocesses.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable


# ---------------------------------------------------------------------------------------------- command line
def parser(doc: str, name: str, choices: Iterable[str], steps: int, steps_help: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring as the description, ``--<name>`` (which of ``choices`` to run, all by
    default), ``--steps`` (default ``steps``) and ``--warmup``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(f"--{name}", nargs="+", default=list(choices), choices=list(choices))
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--warmup", type=int, default=2)
    return p


def add_run_options(p: argparse.ArgumentParser, repeats_help: str) -> None:
    """``--repeats``, ``--json``, and the options a worker subprocess is called with (hidden)."""
    p.add_argument("--repeats", type=int, default=2, help=repeats_help)
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--worker", choices=["trl", "ours"], help=argparse.SUPPRESS)
    p.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)


# ---------------------------------------------------------------------------------------------- workers
def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def peak_mb(device: str = "cpu") -> float:
    """Peak resident memory of this process (CPU) or peak allocated GPU memory (CUDA), in MB."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_worker(script: str, argv: list[str], what: str) -> dict:
    """Run ``script --worker ...`` (``argv``) in a subprocess of its own and return the dict of its ``RESULT`` line;
    exit naming ``what`` if it failed."""
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def worker_report(run: Callable[[], dict]) -> None:
    """In a worker subprocess: offline, quiet, run, print the one ``RESULT`` line ``run_worker`` reads."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    print("RESULT " + json.dumps(run()), flush=True)


def alternate(script: str, workers: tuple[str, ...], repeats: int, argv: list[str], label: str,
              detail: Callable[[dict], str] = lambda run: "") -> dict[str, list[dict]]:
    """``repeats`` rounds of one ``script --worker <w> argv`` run per worker, in the order of ``workers``, so machine
    noise hits each alike; prints each run's median step time (and ``detail(run)``) as it ends."""
    runs: dict[str, list[dict]] = {worker: [] for worker in workers}
    for _ in range(repeats):
        for worker in workers:
            run = run_worker(script, ["--worker", worker, *argv], f"{worker} run for {label}")
            runs[worker].append(run)
            print(f"  {label} {worker}: median {statistics.median(run['step_times']):.3f} s/step{detail(run)}",
                  flush=True)
    return runs


def step_times(start: float, ends: list[float], warmup: int) -> list[float]:
    """The duration of every step after the first ``warmup`` (step ``i`` ends at ``ends[i]``; training started at
    ``start``)."""
    marks = [start, *ends]
    return [b - a for a, b in zip(marks, marks[1:])][warmup:]


def adamw(lr: float) -> Callable[[Any], Any]:
    """Our optimiser factory in every side-by-side: AdamW at ``lr`` without weight decay, PyTorch's fused kernel --
    what TRL's trainer runs by default (``optim="adamw_torch_fused"`` from torch 2.8, set explicitly in ``train_trl``)
    rather than the Python loop over parameters that ``torch.optim.AdamW`` is on a CPU by default."""

    def make(params: Any) -> Any:
        import torch

        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)

    return make


def train_trl(model: Any, tok: Any, reward: Callable[..., list[float]], rows: list[dict], *, prompts: int,
              group: int, max_new: int, lr: float, warmup: int, steps: int, device: str = "cpu",
              micro_batch: int | None = None, **config: Any) -> tuple[list[float], list[dict]]:
    """TRL's ``GRPOTrainer`` on ``rows`` for ``warmup + steps`` steps with the settings both benchmarks use
    (``prompts`` x ``group`` completions of at most ``max_new`` tokens, temperature 1, top-p 1, beta 0, the "grpo"
    loss, group std scaling, one update per batch, fused AdamW at ``lr`` without weight decay, grad-norm clip 1, fp32
    unless ``config`` sets ``bf16=True``; ``config`` adds to them; ``micro_batch``: the update in micro-batches of
    that many rows, ``per_device_train_batch_size`` with gradient accumulation over the one generation of
    ``prompts x group`` rows). Returns ``(the times of the steps after the warm-up, TRL's log history)``."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    ends: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
            synchronize(device)
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=device == "cpu", fp16=False, gradient_checkpointing=False,
            per_device_train_batch_size=micro_batch or prompts * group,
            gradient_accumulation_steps=prompts * group // (micro_batch or prompts * group), num_generations=group,
            max_completion_length=max_new,
            temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="grpo", scale_rewards="group",
            num_iterations=1, learning_rate=lr, optim="adamw_torch_fused", weight_decay=0.0, max_grad_norm=1.0,
            lr_scheduler_type="constant",
            warmup_steps=0, max_steps=warmup + steps, report_to="none", logging_steps=1, save_strategy="no",
            disable_tqdm=True, seed=0, dataloader_num_workers=0, **{"bf16": False, **config},
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                              train_dataset=Dataset.from_list(rows), callbacks=[Timer()])
        start = time.perf_counter()
        trainer.train()
    return step_times(start, ends, warmup), trainer.state.log_history


#: the local SmolLM2-135M-Instruct checkpoint ``experiments/smollm2.py`` builds (nothing is downloaded)
SMOLLM2 = Path("~/.cache/rl_lightning/SmolLM2-135M-Instruct").expanduser()


def add_model_option(p: argparse.ArgumentParser) -> None:
    """``--model DIR``: a local Hugging Face checkpoint directory, SmolLM2-135M-Instruct's by default."""
    p.add_argument("--model", type=Path, default=SMOLLM2,
                   help=f"local Hugging Face checkpoint directory (default {SMOLLM2}; never downloaded)")


def checkpoint_dir(path: Path) -> Path:
    """``path`` expanded, or exit with the one line that says how to get a checkpoint there."""
    path = path.expanduser()
    if not (path / "config.json").is_file():
        sys.exit(f"no checkpoint at {path}: build it with experiments/smollm2.py, or pass --model DIR")
    return path


def chat_prompt_batch(tok: Any, rows: int) -> tuple[Any, Any]:
    """The rollout benchmarks' batch: ``rows // 8`` apple word problems in ``tok``'s chat template, 8 rows each,
    left-padded (ids and attention mask)."""
    from rl_lightning.rollout.sessions import left_pad

    texts = [f"Tom has {a} apples and buys {b} more. How many apples does he have now? Answer with a number."
             for a, b in zip(range(3, 3 + rows // 8), range(5, 5 + rows // 8))]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
               for t in texts]
    prompts = [ids if isinstance(ids, list) else ids["input_ids"] for ids in prompts]
    return left_pad([ids for ids in prompts for _ in range(8)], tok.pad_token_id, "cpu")


def alternate_rollouts(ways: dict[str, tuple[Any, Callable[[], Any]]], ids: Any, mask: Any, params: Any,
                       repeats: int, after_round: Callable[[int, dict[str, Any], dict[str, list[float]]], None]
                       ) -> dict[str, list[float]]:
    """Sample the batch ``ids``/``mask`` once per way and round, in alternation, ``repeats`` rounds: a way is ``(model,
    patch)``, ``patch()`` a context manager that sets the library up for it (``unittest.mock.patch.object``); round
    ``r`` seeds the generator with ``r``. ``after_round(r, outputs, times)`` runs after each round. Returns each
    way's rollout times."""
    import torch

    from rl_lightning.rollout.generation import DecodeOptions, sample

    times: dict[str, list[float]] = {name: [] for name in ways}
    for repeat in range(repeats):
        out = {}
        for name, (model, patch) in ways.items():
            with patch():
                start = time.perf_counter()
                out[name] = sample(model, ids, mask, params, torch.Generator().manual_seed(repeat), None,
                                   DecodeOptions())
                times[name].append(time.perf_counter() - start)
        after_round(repeat, out, times)
    return times


def listed_task(pairs: list[tuple[str, str | None]]) -> Any:
    """A task whose training prompt ``i`` is ``pairs[i % len(pairs)]`` (text, answer); no held-out prompts."""
    from rl_lightning.envs import Prompt, Task

    class Prompts(Task):
        def train_prompt(self, index: int) -> Prompt:
            text, answer = pairs[index % len(pairs)]
            return Prompt(text, answer=answer)

        def heldout_prompts(self) -> list[Prompt]:
            return []

    return Prompts()


def function_reward(fn: Callable[[Any, str], float]) -> Any:
    """The reward function ``fn(prompt, response)``."""
    from rl_lightning.envs import RewardFunction

    class Reward(RewardFunction):
        def __call__(self, prompt: Any, response: str) -> float:
            return fn(prompt, response)

    return Reward()


def fit_ours(module: Any, datamodule: Any, *, warmup: int, steps: int, on_batch: Callable[[Any, Any, Any], None],
             on_start: Callable[[Any], None] = lambda pl_module: None, device: str = "cpu",
             callbacks: Iterable[Any] = (), precision: str = "32-true") -> list[float]:
    """Our ``Trainer.fit`` for ``warmup + steps`` steps, no validation, logging or checkpoints; ``on_start(pl_module)``
    as training starts and ``on_batch(trainer, pl_module, batch)`` after each step (``callbacks``: more Lightning
    callbacks, after the timer; ``precision``: Lightning's). Returns the times of the steps after the warm-up."""
    from lightning.pytorch import Callback, Trainer

    ends: list[float] = []

    class Timer(Callback):
        def on_train_start(self, trainer, pl_module):  # noqa: ANN001
            on_start(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            synchronize(device)
            ends.append(time.perf_counter())
            on_batch(trainer, pl_module, batch)

    trainer = Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=warmup + steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer(), *callbacks],
                      precision=precision)
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    return step_times(start, ends, warmup)


# ---------------------------------------------------------------------------------------------- report
def machine_line(extra: str = "") -> str:
    """``machine: <arch>, <n> CPU cores, torch <version> (<n> threads), python <version>`` and ``extra``."""
    import torch

    return (f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), python {platform.python_version()}{extra}")


def print_table(header: list[str], rows: Iterable[list[str]]) -> None:
    """A Markdown table."""
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_step_summary(started: float, rows: list[dict], decimals: int) -> None:
    """The run's total time and the load average at its end, then per workload TRL's and our median s/step (with
    ``decimals``), their ratio and both peak RSS (``rows``: ``{"workload", "ratio", "trl": {...}, "ours": {...}}``)."""
    print(f"\n(total {time.perf_counter() - started:.0f} s; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    print()
    print_table(["workload", "TRL s/step", "ours s/step", "ratio ours/TRL", "TRL peak RSS", "ours peak RSS"],
                ([r["workload"], f"{r['trl']['s_per_step']:.{decimals}f}", f"{r['ours']['s_per_step']:.{decimals}f}",
                  f"{r['ratio']:.2f}", f"{r['trl']['peak_rss_mb']:.0f} MB", f"{r['ours']['peak_rss_mb']:.0f} MB"]
                 for r in rows))


def write_json(path: Path | None, table: list[dict], runs: dict) -> None:
    """With ``--json``: the table's rows and every run's raw results."""
    if path:
        path.write_text(json.dumps({"table": table, "runs": runs}, indent=1))
