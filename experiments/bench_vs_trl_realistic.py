"""Realistic GRPO workloads, TRL's ``GRPOTrainer`` against rl_lightning's ``GRPO``, identical settings.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_vs_trl_realistic.py \
        [--workloads embedded long-graded long-sparse] [--steps 5] [--warmup 2] [--long-steps 2] [--long-warmup 1]
        [--repeats 2] [--json out.json]

The synthetic ``experiments/bench_vs_trl.py`` times random models whose every group has reward spread and
whose prompts are 5 tokens. These workloads are what training looks like:

* ``embedded``: the shipped warm-started model (``embedded:arithmetic``, 1.1M parameters, character tokenizer)
  on ``configs/grpo.yaml``'s settings: ``ArithmeticTask(2 digits, "+", seed 1234)``, 16 prompts x G = 8, at most
  6 new tokens, temperature 1, fused AdamW lr 1e-4 (no weight decay), grad-norm clip 1, seq-mean-token-mean loss
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
ours, TRL, ours, TRL, ...; the first ``--warmup`` (``--long-warmup`` for the long workloads) steps of each run are
not timed. A long workload's TRL step takes ~45 s on a loaded 2-core CPU, hence fewer timed steps there (the
whole default run takes ~13 minutes on that machine).

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
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as common  # noqa: E402
from bench_vs_trl import build_checkpoint, prompt_texts, reward_value  # noqa: E402

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
    """Counts positions through a decoder's forward: with gradient, and without it in forwards of > 1 column
    (``nograd``) and of any width (``nograd_all``)."""

    def __init__(self) -> None:
        self.grad = self.nograd = self.nograd_all = 0

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
                return
            self.nograd_all += n * t
            if t > 1:
                self.nograd += n * t

        decoder.register_forward_pre_hook(hook, with_kwargs=True)


# ---------------------------------------------------------------------------------------------- workers
def run_trl(workload: str, ckpt: Path, steps: int, warmup: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = WORKLOADS[workload]
    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    work = Work()
    work.attach(model)

    def trl_reward(completions, answer, **kwargs):  # noqa: ANN001, ANN003
        return [reward(spec["reward"], c, a) for c, a in zip(completions, answer)]

    bos = tok.bos_token if spec["bos"] else ""
    rows = [{"prompt": bos + text, "answer": answer}
            for text, answer in prompts(workload, ckpt, spec["prompts"] * (warmup + steps + 2))]
    times, log = common.train_trl(model, tok, trl_reward, rows, prompts=spec["prompts"], group=GROUP,
                                  max_new=spec["max_new"], lr=spec["lr"], warmup=warmup, steps=steps, epsilon=0.2,
                                  shuffle_dataset=False)
    logs = [h for h in log if "completions/mean_length" in h]
    n = len(logs)
    per_step = spec["prompts"] * GROUP
    return {
        "step_times": times, "peak_rss_mb": common.peak_mb(), "steps": n,
        "completion_tokens": statistics.mean(h["completions/mean_length"] for h in logs) * per_step,
        "zero_std_rows": statistics.mean(h["frac_reward_zero_std"] for h in logs) * per_step,
        "skipped_rows": 0.0, "reward": statistics.mean(h["reward"] for h in logs),
        "grad_positions": work.grad / n, "nograd_positions": work.nograd / n,
        "prompt_tokens": statistics.mean(len(tok(r["prompt"])["input_ids"]) for r in rows),
    }


def run_ours(workload: str, ckpt: Path, steps: int, warmup: int) -> dict:
    from rl_lightning.algorithms import GRPO
    from rl_lightning.rollout import PromptFormat, RolloutDataModule, Sampling
    from rl_lightning.rollout.settings import grouped

    spec = WORKLOADS[workload]
    cfg = config()
    pairs = prompts(workload, ckpt, spec["prompts"] * (warmup + steps + 2))
    work = Work()
    logged: list[dict[str, float]] = []

    def on_batch(trainer, pl_module, batch):  # noqa: ANN001
        m = trainer.callback_metrics
        logged.append({"tokens": float(batch.loss_mask.sum()), "skipped": float(m["train/skipped_rows"]),
                       "zero_std": float(m["train/zero_std_fraction"]), "reward": float(m["train/reward"]),
                       "prompt_tokens": float(batch.attention_mask[:, :batch.prompt_length].sum(1).float().mean())})

    model_args = {k: v for k, v in cfg["model"]["init_args"].items() if k != "optimizer"}  # configs/grpo.yaml
    model_args["model_name_or_path"] = "embedded:arithmetic" if spec["model"] == "embedded" else str(ckpt)
    module = GRPO(**model_args, optimizer=common.adamw(spec["lr"]))
    data = grouped({k: v for k, v in cfg["data"]["init_args"].items() if k not in ("task", "evaluation")})
    data.update(prompts_per_step=spec["prompts"], group_size=GROUP,
                sampling=replace(data.get("sampling", Sampling()), max_new_tokens=spec["max_new"], temperature=1.0,
                                 top_p=1.0),
                prompt_format=replace(data.get("prompt_format", PromptFormat()), add_bos=spec["bos"]))
    datamodule = RolloutDataModule(
        task=common.listed_task(pairs),
        reward_fn=common.function_reward(lambda prompt, response: reward(spec["reward"], response, prompt.answer)),
        **data)
    times = common.fit_ours(module, datamodule, warmup=warmup, steps=steps, on_batch=on_batch,
                            on_start=lambda pl_module: work.attach(pl_module.policy))
    n, per_step = len(logged), spec["prompts"] * GROUP
    return {
        "step_times": times, "peak_rss_mb": common.peak_mb(), "steps": n,
        "completion_tokens": statistics.mean(s["tokens"] for s in logged),
        "zero_std_rows": statistics.mean(s["zero_std"] for s in logged) * per_step,
        "skipped_rows": statistics.mean(s["skipped"] for s in logged) * per_step,
        "reward": statistics.mean(s["reward"] for s in logged),
        "grad_positions": work.grad / n, "nograd_positions": work.nograd / n,
        "prompt_tokens": statistics.mean(s["prompt_tokens"] for s in logged),
    }


# ---------------------------------------------------------------------------------------------- report
def main() -> None:
    p = common.parser(__doc__, "workloads", WORKLOADS, 5, "timed steps per run (after warm-up), embedded")
    p.add_argument("--long-steps", type=int, default=2, help="timed steps per run of the long workloads")
    p.add_argument("--long-warmup", type=int, default=1)
    common.add_run_options(p, "alternating ours/TRL runs per workload")
    p.add_argument("--workload", choices=list(WORKLOADS), help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:  # a subprocess: train, print one JSON line
        run = run_trl if args.worker == "trl" else run_ours
        common.worker_report(lambda: run(args.workload, args.ckpt, args.steps, args.warmup))
        return

    load = os.getloadavg()
    print(common.machine_line(f", load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"))
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
            runs = common.alternate(
                __file__, ("ours", "trl"), args.repeats,
                ["--workload", workload, "--ckpt", str(ckpt), "--steps", str(steps), "--warmup", str(warmup)], workload,
                lambda r: f" ({' '.join(f'{t:.3f}' for t in r['step_times'])}), peak RSS {r['peak_rss_mb']:.0f} MB, "
                          f"load {os.getloadavg()[0]:.2f}")
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

    common.print_step_summary(started, rows, decimals=3)
    print("\nWork per step (means over all steps): rows = prompts x G; prompt = mean prompt tokens; sampled = "
          "completion")
    print("tokens; zero-var = rows in zero-variance groups; skipped = rows the update did not forward; update fwd =")
    print("positions forwarded with gradient; prefill = positions forwarded without gradient in forwards of > 1 "
          "column:")
    common.print_table(
        ["workload", "framework", "rows", "prompt", "sampled", "mean reward", "zero-var rows", "skipped rows",
         "update fwd", "prefill"],
        ([r["workload"], name, str(WORKLOADS[r["workload"]]["prompts"] * GROUP), f"{w['prompt_tokens']:.1f}",
          f"{w['completion_tokens']:.0f}", f"{w['reward']:.3f}", f"{w['zero_std_rows']:.1f}",
          f"{w['skipped_rows']:.1f}", f"{w['grad_positions']:.0f}", f"{w['nograd_positions']:.0f}"]
         for r in rows for name, w in (("TRL", r["trl"]), ("ours", r["ours"]))))
    common.write_json(args.json, rows, everything)


if __name__ == "__main__":
    main()
