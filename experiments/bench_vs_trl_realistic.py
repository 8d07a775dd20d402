"""Realistic GRPO workloads, TRL's ``GRPOTrainer`` against rl_lightning's ``GRPO``, identical settings.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_vs_trl_realistic.py \
        [--workloads embedded long-graded long-sparse] [--steps 5] [--warmup 2] [--long-steps 2] [--long-warmup 1]
        [--repeats 2] [--json out.json]

The synthetic ``experiments/bench_vs_trl.py`` times random models whose every group has reward spread and
whose prompts are 5 tokens. These workloads are what training looks like:

* ``embedded``: the shipped warm-started model (``embedded:arithmetic``, 1.1M parameters, character tokenizer)
  on ``configs/grpo.yaml``'s settings: ``ArithmeticTask(2 digits, "+", seed 1234)``, 16 prompts x G = 8, at most
  6 new tokens, temperature 1, AdamW lr 1e-4 (no weight decay), grad-norm clip 1, seq-mean-token-mean loss
  (TRL ``loss_type="grpo"``), group std scaling, beta = 0, one update per batch; the task's own reward (exact
  match of the answer), so groups where all 8 answers are right or all wrong (zero variance) occur as in training.
  Prompts are BOS + ``"a+b="`` in both (our data module's ``add_bos``; for TRL the text starts with ``<bos>``,
  which the tokenizer maps to the BOS id).
* ``long-graded``: ``bench_vs_trl``'s 10.8M Llama (random weights, BPE vocab 512, 512 positions) with a fixed
  200-token instruction block before each ``"a+b="`` question (~205 prompt tokens), 8 prompts x G = 8, at most
  32 new tokens, lr 1e-5; reward: the fraction of the completion's characters that are digits (graded: every
  group has spread, as in ``bench_vs_trl``).
* ``long-sparse``: the same, reward 1 if the correct sum appears anywhere in the completion, else 0: a random
  model rarely writes it, so most groups are constant (all 0) and their rows carry no gradient.

Both frameworks use one checkpoint, one tokenizer, the same prompts in the same order (TRL
``shuffle_dataset=False``; our ``SequentialSampler``), the same reward function, fp32, no gradient
checkpointing, no vLLM, top-p 1 (TRL ``top_k=0``). Each run is a subprocess (its own peak RSS); runs alternate
ours, TRL, ours, TRL, ...; the first ``--warmup`` (``--long-warmup`` for the long workloads) steps of each run are not timed. A long
workload's TRL step takes ~45 s on a loaded 2-core CPU, hence fewer timed steps there (the whole default run
takes ~13 minutes on that machine).

Printed per workload: median s/step, ratio ours/TRL, peak RSS, and the work each framework did per step
(means over all steps of all runs): completion tokens sampled, positions forwarded with gradient (the update;
counted by a hook on the decoder's forward, so a shared prompt forward counts its prefix once), positions
prefilled or scored without gradient in forwards of more than one column (generation's prefill; a decode step
is one column and is not counted; our static-cache decode does not go through the hooked forward), rows in
zero-variance groups, and rows our update skipped (``train/skipped_rows``; TRL forwards every row).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import build_checkpoint, peak_mb, prompt_texts, reward_value, run_worker, worker_report  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
GROUP = 8
INSTRUCTION_TOKENS = 200
INSTRUCTION = ("You are a careful calculator. Read the two numbers below, add them digit by digit from the right, "
               "carry when a column sums to ten or more, and write only the final sum, with no spaces, no words "
               "and no explanation, then stop. ") * 4
WORKLOADS = {
    # name: model, prompts per step, max new tokens, lr, reward, add BOS
    "embedded": dict(model="embedded", prompts=16, max_new=6, lr=1e-4, reward="exact", bos=True),
    "long-graded": dict(model="long", prompts=8, max_new=32, lr=1e-5, reward="digits", bos=False),
    "long-sparse": dict(model="long", prompts=8, max_new=32, lr=1e-5, reward="contains", bos=False),
}


# ---------------------------------------------------------------------------------------------- shared setup
def config() -> dict:
    import yaml

    return yaml.safe_load((REPO_ROOT / "configs" / "grpo.yaml").read_text())


def long_checkpoint(out: Path) -> Path:
    """bench_vs_trl's 10.8M Llama checkpoint (BPE vocab 512), with room for 512 positions."""
    build_checkpoint("10.8M", out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 512
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def checkpoint(workload: str, tmp: Path) -> Path:
    if WORKLOADS[workload]["model"] == "embedded":
        from rl_lightning.models.policy import resolve_model_path

        return resolve_model_path("embedded:arithmetic")
    path = tmp / "long"
    return path if (path / "config.json").is_file() else long_checkpoint(path)


def prompts(workload: str, ckpt: Path, count: int) -> list[tuple[str, str]]:
    """``count`` (prompt text without BOS, answer) pairs, in stream order."""
    if WORKLOADS[workload]["model"] == "embedded":
        from rl_lightning.envs import ArithmeticTask

        task = ArithmeticTask(**config()["data"]["init_args"]["task"]["init_args"])
        return [(p.text, p.answer) for p in (task.train_prompt(i) for i in range(count))]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    block = tok.decode(tok(INSTRUCTION, add_special_tokens=False)["input_ids"][:INSTRUCTION_TOKENS])
    block = block.rstrip() + "\n"
    out = []
    for text in prompt_texts(count):
        a, b = text[:-1].split("+")
        out.append((block + text, str(int(a) + int(b))))
    return out


def reward(name: str, completion: str, answer: str) -> float:
    if name == "exact":  # rl_lightning.envs.ExactMatchReward, the ArithmeticTask's default
        return 1.0 if completion.strip() == answer.strip() else 0.0
    if name == "digits":
        return reward_value(completion)
    return 1.0 if answer in completion else 0.0


class Work:
    """Counts positions through a decoder's forward: with gradient, and without it in forwards of > 1 column."""

    def __init__(self) -> None:
        self.grad = self.nograd = 0

    def attach(self, model) -> None:  # noqa: ANN001
        import torch

        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model

        def hook(module, args, kwargs):  # noqa: ANN001, ANN202
            x = kwargs.get("input_ids")
            if x is None:
                x = args[0] if args else kwargs.get("inputs_embeds")
            n, t = x.shape[0], x.shape[1]
            if torch.is_grad_enabled():
                self.grad += n * t
            elif t > 1:
                self.nograd += n * t

        decoder.register_forward_pre_hook(hook, with_kwargs=True)


# ---------------------------------------------------------------------------------------------- workers
def run_trl(workload: str, ckpt: Path, steps: int, warmup: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = WORKLOADS[workload]
    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    work = Work()
    work.attach(model)
    ends: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
            ends.append(time.perf_counter())

    def trl_reward(completions, answer, **kwargs):  # noqa: ANN001, ANN003
        return [reward(spec["reward"], c, a) for c, a in zip(completions, answer)]

    bos = tok.bos_token if spec["bos"] else ""
    rows = [{"prompt": bos + text, "answer": answer}
            for text, answer in prompts(workload, ckpt, spec["prompts"] * (warmup + steps + 2))]
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
            per_device_train_batch_size=spec["prompts"] * GROUP, num_generations=GROUP,
            max_completion_length=spec["max_new"], temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
            loss_type="grpo", scale_rewards="group", epsilon=0.2, num_iterations=1, learning_rate=spec["lr"],
            weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
            max_steps=warmup + steps, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
            seed=0, dataloader_num_workers=0, shuffle_dataset=False,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=args, processing_class=tok,
                              train_dataset=Dataset.from_list(rows), callbacks=[Timer()])
        start = time.perf_counter()
        trainer.train()
    marks = [start, *ends]
    times = [b - a for a, b in zip(marks, marks[1:])][warmup:]
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    n = len(logs)
    per_step = spec["prompts"] * GROUP
    return {
        "step_times": times, "peak_rss_mb": peak_mb(), "steps": n,
        "completion_tokens": statistics.mean(h["completions/mean_length"] for h in logs) * per_step,
        "zero_std_rows": statistics.mean(h["frac_reward_zero_std"] for h in logs) * per_step,
        "skipped_rows": 0.0, "reward": statistics.mean(h["reward"] for h in logs),
        "grad_positions": work.grad / n, "nograd_positions": work.nograd / n,
        "prompt_tokens": statistics.mean(len(tok(r["prompt"])["input_ids"]) for r in rows),
    }


def run_ours(workload: str, ckpt: Path, steps: int, warmup: int) -> dict:
    import torch
    from lightning.pytorch import Callback, Trainer

    from rl_lightning.algorithms import GRPO
    from rl_lightning.envs import Prompt, RewardFunction, Task
    from rl_lightning.rollout import RolloutDataModule

    spec = WORKLOADS[workload]
    cfg = config()
    pairs = prompts(workload, ckpt, spec["prompts"] * (warmup + steps + 2))

    class Prompts(Task):
        def train_prompt(self, index: int) -> Prompt:
            text, answer = pairs[index % len(pairs)]
            return Prompt(text, answer=answer)

        def heldout_prompts(self) -> list[Prompt]:
            return []

    class Reward(RewardFunction):
        def __call__(self, prompt: Prompt, response: str) -> float:
            return reward(spec["reward"], response, prompt.answer)

    work = Work()
    ends: list[float] = []
    logged: list[dict[str, float]] = []

    class Timer(Callback):
        def on_train_start(self, trainer, pl_module):  # noqa: ANN001
            work.attach(pl_module.policy)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            ends.append(time.perf_counter())
            m = trainer.callback_metrics
            logged.append({"tokens": float(batch.loss_mask.sum()), "skipped": float(m["train/skipped_rows"]),
                           "zero_std": float(m["train/zero_std_fraction"]), "reward": float(m["train/reward"]),
                           "prompt_tokens": float(batch.attention_mask[:, :batch.prompt_length].sum(1).float().mean())})

    model_args = {k: v for k, v in cfg["model"]["init_args"].items() if k != "optimizer"}  # configs/grpo.yaml
    model_args["model_name_or_path"] = "embedded:arithmetic" if spec["model"] == "embedded" else str(ckpt)
    module = GRPO(**model_args, optimizer=lambda p: torch.optim.AdamW(p, lr=spec["lr"], weight_decay=0.0))
    data = {k: v for k, v in cfg["data"]["init_args"].items() if k not in ("task", "val_batch_size")}
    data.update(prompts_per_step=spec["prompts"], group_size=GROUP, max_new_tokens=spec["max_new"],
                temperature=1.0, top_p=1.0, add_bos=spec["bos"])
    datamodule = RolloutDataModule(task=Prompts(), reward_fn=Reward(), **data)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=warmup + steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer()])
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    marks = [start, *ends]
    times = [b - a for a, b in zip(marks, marks[1:])][warmup:]
    n, per_step = len(logged), spec["prompts"] * GROUP
    return {
        "step_times": times, "peak_rss_mb": peak_mb(), "steps": n,
        "completion_tokens": statistics.mean(s["tokens"] for s in logged),
        "zero_std_rows": statistics.mean(s["zero_std"] for s in logged) * per_step,
        "skipped_rows": statistics.mean(s["skipped"] for s in logged) * per_step,
        "reward": statistics.mean(s["reward"] for s in logged),
        "grad_positions": work.grad / n, "nograd_positions": work.nograd / n,
        "prompt_tokens": statistics.mean(s["prompt_tokens"] for s in logged),
    }


# ---------------------------------------------------------------------------------------------- report
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after warm-up), embedded")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--long-steps", type=int, default=2, help="timed steps per run of the long workloads")
    parser.add_argument("--long-warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="alternating ours/TRL runs per workload")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--worker", choices=["trl", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=list(WORKLOADS), help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:  # a subprocess: train, print one JSON line
        run = run_trl if args.worker == "trl" else run_ours
        worker_report(lambda: run(args.workload, args.ckpt, args.steps, args.warmup))
        return

    import platform

    import torch

    load = os.getloadavg()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), python {platform.python_version()}, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    code = subprocess.run(["git", "log", "-1", "--oneline"], cwd=REPO_ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--short", "--", "rl_lightning"], cwd=REPO_ROOT, capture_output=True,
                           text=True).stdout.split()[1::2]
    print(f"code: {code.strip()}; uncommitted changes in: {', '.join(dirty) or 'none'}")
    print(f"embedded: {args.warmup} warm-up + {args.steps} timed steps per run; long: {args.long_warmup} + "
          f"{args.long_steps}; {args.repeats} alternating runs per framework (ours first)")
    rows, everything = [], {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads:
            ckpt = checkpoint(workload, Path(tmp))
            long = WORKLOADS[workload]["model"] == "long"
            steps, warmup = (args.long_steps, args.long_warmup) if long else (args.steps, args.warmup)
            runs: dict[str, list[dict]] = {"ours": [], "trl": []}
            for _ in range(args.repeats):
                for worker in ("ours", "trl"):
                    runs[worker].append(run_worker(__file__, [
                        "--worker", worker, "--workload", workload, "--ckpt", str(ckpt), "--steps", str(steps),
                        "--warmup", str(warmup)], f"{worker} run for {workload}"))
                    r = runs[worker][-1]
                    print(f"  {workload} {worker}: median {statistics.median(r['step_times']):.3f} s/step "
                          f"({' '.join(f'{t:.3f}' for t in r['step_times'])}), peak RSS {r['peak_rss_mb']:.0f} MB, "
                          f"load {os.getloadavg()[0]:.2f}", flush=True)
            row = {"workload": workload}
            for worker, rs in runs.items():
                row[worker] = {"s_per_step": statistics.median(t for r in rs for t in r["step_times"]),
                               "peak_rss_mb": max(r["peak_rss_mb"] for r in rs)}
                for key in ("completion_tokens", "zero_std_rows", "skipped_rows", "reward", "grad_positions",
                            "nograd_positions", "prompt_tokens"):
                    row[worker][key] = statistics.mean(r[key] for r in rs)
            row["ratio"] = row["ours"]["s_per_step"] / row["trl"]["s_per_step"]
            rows.append(row)
            everything[workload] = runs

    print(f"\n(total {time.perf_counter() - started:.0f} s; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    print("\n| workload | TRL s/step | ours s/step | ratio ours/TRL | TRL peak RSS | ours peak RSS |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        t, o = r["trl"], r["ours"]
        print(f"| {r['workload']} | {t['s_per_step']:.3f} | {o['s_per_step']:.3f} | {r['ratio']:.2f} | "
              f"{t['peak_rss_mb']:.0f} MB | {o['peak_rss_mb']:.0f} MB |")
    print("\nWork per step (means over all steps): rows = prompts x G; prompt = mean prompt tokens; sampled = completion")
    print("tokens; zero-var = rows in zero-variance groups; skipped = rows the update did not forward; update fwd =")
    print("positions forwarded with gradient; prefill = positions forwarded without gradient in forwards of > 1 column:")
    print("| workload | framework | rows | prompt | sampled | mean reward | zero-var rows | skipped rows | update fwd | prefill |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        n = WORKLOADS[r["workload"]]["prompts"] * GROUP
        for name, key in (("TRL", "trl"), ("ours", "ours")):
            w = r[key]
            print(f"| {r['workload']} | {name} | {n} | {w['prompt_tokens']:.1f} | {w['completion_tokens']:.0f} | "
                  f"{w['reward']:.3f} | {w['zero_std_rows']:.1f} | {w['skipped_rows']:.1f} | "
                  f"{w['grad_positions']:.0f} | {w['nograd_positions']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"table": rows, "runs": everything}, indent=1))


if __name__ == "__main__":
    main()
