"""SmolLM2-135M-Instruct GRPO, TRL's ``GRPOTrainer`` against rl_lightning's ``GRPO``: full fine-tuning and LoRA.

    OMP_NUM_THREADS=1 /path/to/venv-with-trl/bin/python experiments/bench_vs_trl_smollm2.py
        [--workloads full lora] [--steps 2] [--warmup 1] [--repeats 2] [--model DIR] [--json out.json]
        [--prompts 8] [--group 8] [--max-new 32] [--equal-work] [--precisions fp32 bf16] [--micro-batch 16]

The model is a local checkpoint directory (default ``~/.cache/rl_lightning/SmolLM2-135M-Instruct``, built by
``experiments/smollm2.py``; nothing is downloaded). TRL comes with the ``bench`` extra (``pip install -e
".[bench,lora]"``).

Settings, identical in both frameworks: fp32 (``--precisions``: below), no gradient checkpointing, no vLLM; 8
prompts x G = 8 completions of at most 32 new tokens (``--prompts``, ``--group``, ``--max-new``; smaller for a quick
check of the script), temperature 1, top-p 1 (TRL ``top_k=0``); beta = 0 (no reference model); one update per batch
(TRL ``num_iterations=1``, ours ``num_iterations=1, num_minibatches=1``), clip 0.2, seq-mean-token-mean loss (TRL
``loss_type="grpo"``), group std scaling; fused AdamW (TRL's default ``adamw_torch_fused``) without weight decay at
lr 1e-6 (``full``) or 1e-4 (``lora``), grad-norm clip 1.

* ``full``: every weight trains.
* ``lora``: LoRA rank 16, alpha 32, dropout 0 on ``q_proj, k_proj, v_proj, o_proj`` (ours:
  ``models.adapters.LoraSettings``; TRL: the same ``peft.LoraConfig`` as ``peft_config``).

``--equal-work``: our update forwards every row, as TRL's does (``skip_inert_rows=False``: the rows of
zero-variance groups, whose loss and gradient are exactly zero, are not skipped); each group's prompt still runs once
in the update and the rollout (the shared prompt forward, one of the levers measured, not a change of the work).

``--precisions fp32 bf16`` runs each workload in both (``fp32`` alone by default). ``bf16``: each framework's
bf16 autocast over fp32 weights, the CPU's bf16 matrix products where it has them (AVX512-BF16, AMX): ours
Lightning's ``precision="bf16-mixed"`` with the rollout sampled from a bf16 copy of the policy
(``sampling.dtype: bfloat16``, re-synchronised every step); TRL ``bf16=True``, whose autocast covers its loss
computation: its generation stays fp32 (its sampled tokens and rewards equal its fp32 runs', 2026-12-07), so the two
bf16 settings differ there. The FLOP rates of a bf16 row are reported against both the fp32 and the bf16
matrix-product throughput measured in the worker.

``--micro-batch N``: both updates in micro-batches of ``N`` rows with their gradients accumulated into the one
optimiser step (ours ``micro_batch_size``; TRL ``per_device_train_batch_size=N`` with ``gradient_accumulation_steps``
covering the one generation of prompts x G rows): the same update in less memory (default: the whole batch at once).

Prompts: ``ArithmeticWordTask`` word problems with ``configs/tasks/smollm2_words.yaml``'s settings (operands 2..20,
``+`` and ``-``, its held-out and validation splits never drawn, seed 1234), in stream order on both sides (TRL
``shuffle_dataset=False``), each a user message rendered with the tokenizer's chat template (ours: the data
module's ``use_chat_template``, as ``configs/grpo_smollm2.yaml``; TRL: conversational prompts
``[{"role": "user", "content": ...}]``). Reward: the task's own verifier (``NumericAnswerReward``: the last number
of the answer) on both sides. Our other settings are ``configs/grpo_smollm2.yaml``'s (``logprob_chunk_size`` 16,
the shared prompt forward, inert-row skipping).

Each run is a subprocess (its own peak RSS); runs alternate ours, TRL, ours, TRL, ...; the first ``--warmup`` steps
of each run are not timed. Printed per workload and framework: median s/step over the timed steps of all runs,
ratio ours/TRL, peak RSS, and the work per step (as ``bench_vs_trl_realistic.py``: mean completion tokens, rows in
zero-variance groups, rows our update skipped, positions forwarded with gradient through the decoder and through
the LM head, counted by forward hooks; TRL's fused LM-head forward uses the head's weight without calling the module,
so its head positions are not counted). Memory: TRL's worker needs over 11 GB at 8 x 8 (it was OOM-killed there on
a 24 GB machine shared with training runs; 9-11 GB at ``--prompts 4``): where that does not fit, ``--prompts 4``.

The update's achieved FLOP/s (ours; the CPU analogue of MFU). The update's matrix-product FLOPs of a step are
estimated from the positions forwarded with gradient through the decoder (``P``) and through the LM head
(``P_head``; only the positions whose logits are needed), the decoder's linear-layer weights (``N``: q, k, v, o,
gate, up, down of every layer; the embedding lookup and the norms do no matrix product) and the LM head's
(``N_head`` = vocab x hidden, tied to the embedding in SmolLM2):

    full:  6 x (N x P + N_head x P_head)                          (forward 2, input gradient 2, weight gradient 2)
    lora:  4 x (N x P + N_head x P_head) + 6 x N_adapter x P     (frozen weights: no weight gradient)

with ``N_adapter`` the LoRA A and B weights. Attention's score and value products (~4 x T x hidden per position and
layer, T ~ 80 here) and the entropy, loss and optimiser arithmetic are not counted. FLOP/s = that / the step's
``perf/update_time`` (our logged metric: advantages, the update's forwards and backwards, the optimiser step). It
is compared with the machine's fp32 matrix-product throughput measured in the same worker with the same thread
count: ``torch.matmul`` of two 2048 x 2048 fp32 matrices (2 x 2048^3 FLOPs), best of 5 before and 5 after the
training run. Printed: "update at X% of measured matmul throughput" (median over timed steps of the achieved
FLOP/s, over the best matmul throughput of all our runs).

Generation the same way: ``2 x ((N + N_adapter) x G + N_head x G_head)`` FLOPs a step, with ``G`` the positions
through the decoder without gradient (the prompt forward's, and one per row per decode step: ``StaticDecoder``'s
steps bypass the decoder module and are counted at the LM head, which they call with ``[rows, hidden]``) and
``G_head`` the positions through the LM head without gradient, over ``perf/rollout_time`` (which also holds the
sampling itself and the detokenisation). And the step's arithmetic floor: the update's and generation's FLOPs at the
measured matmul throughput, as a fraction of TRL's median step -- the lowest ratio ours/TRL this estimate of our
work allows in fp32.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as common
from bench_vs_trl_realistic import Work

REPO_ROOT = Path(__file__).resolve().parents[1]
LORA = {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
WORKLOADS = {"full": {"lr": 1e-6, "lora": False}, "lora": {"lr": 1e-4, "lora": True}}
MATMUL_N, MATMUL_REPEATS = 2048, 5
#: per ``--precisions`` entry: our Trainer's precision, our sampler's dtype, TRL's ``bf16``
PRECISIONS = {"fp32": ("32-true", None, False), "bf16": ("bf16-mixed", "bfloat16", True)}


# ---------------------------------------------------------------------------------------------- shared setup
def yaml_config(name: str) -> dict:
    import yaml

    return yaml.safe_load((REPO_ROOT / "configs" / name).read_text())


def task() -> Any:
    """``configs/tasks/smollm2_words.yaml``'s ``ArithmeticWordTask``."""
    from rl_lightning.envs.word_problems import ArithmeticWordTask

    return ArithmeticWordTask(**yaml_config("tasks/smollm2_words.yaml")["data"]["init_args"]["task"]["init_args"])


def prompts(count: int) -> list[tuple[str, str]]:
    """The task's first ``count`` training problems, (text, answer), in stream order."""
    t = task()
    return [(p.text, p.answer) for p in (t.train_prompt(i) for i in range(count))]


def verifier() -> Any:
    """The task's own reward (``NumericAnswerReward``)."""
    return task().default_reward()


class Counts(Work):
    """``bench_vs_trl_realistic.Work`` (positions through the decoder with gradient, and without it in forwards of
    > 1 column), the positions whose LM-head logits are computed with gradient, and generation's positions (the
    module docstring's ``G`` and ``G_head``)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = self.static_steps = self.generated_head = 0

    def attach(self, model) -> None:
        import torch

        super().attach(model)

        def head_hook(module, args):
            positions = args[0].shape[:-1].numel()
            if torch.is_grad_enabled():
                self.head += positions
                return
            self.generated_head += positions
            if args[0].dim() == 2:  # a StaticDecoder step: its positions did not pass the decoder module
                self.static_steps += positions

        model.get_output_embeddings().register_forward_pre_hook(head_hook)

    def snapshot(self) -> tuple[int, int, int, int, int]:
        return self.grad, self.nograd, self.head, self.nograd_all + self.static_steps, self.generated_head


def matmul_flops(n: int = MATMUL_N, repeats: int = MATMUL_REPEATS, dtype: str = "float32") -> float:
    """``torch.matmul`` of two ``n x n`` matrices in ``dtype`` at this process's thread count: best FLOP/s of
    ``repeats``."""
    import torch

    a, b = (torch.randn(n, n, dtype=getattr(torch, dtype)) for _ in range(2))
    torch.matmul(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def linear_sizes(model) -> dict[str, int]:
    """``N`` (the decoder's linear weights, adapters excluded), ``N_head`` and ``N_adapter`` (LoRA A and B)."""
    from torch import nn

    head = model.get_output_embeddings()
    sizes = {"decoder": 0, "head": head.weight.numel(), "adapter": 0}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        sizes["adapter" if "lora_" in name else "decoder"] += module.weight.numel()
    return sizes


def update_flops(sizes: dict[str, int], lora: bool, positions: float, head_positions: float) -> float:
    """The module docstring's estimate of one update's matrix-product FLOPs."""
    frozen = sizes["decoder"] * positions + sizes["head"] * head_positions
    return 4 * frozen + 6 * sizes["adapter"] * positions if lora else 6 * frozen


def generation_flops(sizes: dict[str, int], positions: float, head_positions: float) -> float:
    """The module docstring's estimate of one rollout's matrix-product FLOPs (forwards only)."""
    return 2 * ((sizes["decoder"] + sizes["adapter"]) * positions + sizes["head"] * head_positions)


# ---------------------------------------------------------------------------------------------- workers
def matmul_rates(before: tuple[float, float] | None = None) -> tuple[float, float]:
    """The fp32 and bf16 ``matmul_flops``, each the best of this measurement and ``before``."""
    now = (matmul_flops(), matmul_flops(dtype="bfloat16"))
    return now if before is None else (max(now[0], before[0]), max(now[1], before[1]))


def run_trl(workload: str, ckpt: Path, steps: int, warmup: int, prompts_per_step: int, group: int,
            max_new: int, precision: str = "fp32", micro_batch: int | None = None) -> dict:
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_lightning.envs import Prompt

    spec = WORKLOADS[workload]
    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    counts = Counts()
    counts.attach(model)  # the hooks stay on these modules when peft wraps the model
    if spec["lora"]:
        # bench_common.train_trl builds the GRPOTrainer with every shared setting; peft_config is a trainer argument
        # (not a GRPOConfig one), so it is added by a subclass that train_trl's `from trl import GRPOTrainer` picks up
        from peft import LoraConfig

        lora = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                          target_modules=list(LORA["target_modules"]), bias="none", task_type="CAUSAL_LM")

        class LoraGRPOTrainer(trl.GRPOTrainer):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, peft_config=lora, **kwargs)

        trl.GRPOTrainer = LoraGRPOTrainer
    verify = verifier()

    def trl_reward(completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: messages
        return [verify(Prompt("", answer=a), text) for text, a in zip(texts, answer)]

    rows = [{"prompt": [{"role": "user", "content": text}], "answer": answer}
            for text, answer in prompts(prompts_per_step * (warmup + steps + 2))]
    before = matmul_rates()
    times, log = common.train_trl(model, tok, trl_reward, rows, prompts=prompts_per_step, group=group,
                                  max_new=max_new, lr=spec["lr"], warmup=warmup, steps=steps, epsilon=0.2,
                                  shuffle_dataset=False, bf16=PRECISIONS[precision][2], micro_batch=micro_batch)
    logs = [h for h in log if "completions/mean_length" in h]
    n, per_step = len(logs), prompts_per_step * group
    rendered = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
                for r in rows[:n * prompts_per_step]]
    return {
        "step_times": times, "peak_rss_mb": common.peak_mb(), "steps": n, "threads": torch.get_num_threads(),
        "completion_tokens": statistics.mean(h["completions/mean_length"] for h in logs) * per_step,
        "zero_std_rows": statistics.mean(h["frac_reward_zero_std"] for h in logs) * per_step,
        "skipped_rows": 0.0, "reward": statistics.mean(h["reward"] for h in logs),
        "grad_positions": counts.grad / n, "nograd_positions": counts.nograd / n,
        "head_positions": None,  # TRL's fused_lm_head forward uses the head's weight without calling the module
        "prompt_tokens": statistics.mean(len(tok(t, add_special_tokens=False)["input_ids"]) for t in rendered),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "matmul_flops": matmul_rates(before),
    }


def build_ours(workload: str, ckpt: Path, prompts_per_step: int, group: int, max_new: int, equal_work: bool,
               batches: int, precision: str = "fp32", micro_batch: int | None = None) -> tuple[Any, Any]:
    """Our ``GRPO`` module and data module with the module docstring's settings (``configs/grpo_smollm2.yaml``'s,
    the shared ones overridden as TRL's), over ``batches`` steps of the benchmark's prompts; ``precision``'s
    sampler dtype (``PRECISIONS``); the update in micro-batches of ``micro_batch`` rows (``None``: all at once)."""
    from rl_lightning.algorithms import GRPO
    from rl_lightning.models.adapters import LoraSettings
    from rl_lightning.rollout import PromptFormat, RolloutDataModule, Sampling
    from rl_lightning.rollout.settings import grouped

    spec = WORKLOADS[workload]
    cfg = yaml_config("grpo_smollm2.yaml")
    words = yaml_config("tasks/smollm2_words.yaml")["data"]["init_args"]
    model_args = {k: v for k, v in cfg["model"]["init_args"].items() if k != "optimizer"}  # configs/grpo_smollm2.yaml
    model_args.update(model_name_or_path=str(ckpt), dtype="float32", num_iterations=1, num_minibatches=1,
                      clip_eps_low=0.2, clip_eps_high=0.2, scale_rewards=True, max_grad_norm=1.0,
                      loss_aggregation="seq_mean_token_mean", skip_inert_rows=not equal_work,
                      micro_batch_size=micro_batch)
    if spec["lora"]:
        model_args["lora"] = LoraSettings(**LORA)
    module = GRPO(**model_args, optimizer=common.adamw(spec["lr"]))
    data = grouped({k: v for k, v in {**cfg["data"]["init_args"], **words}.items() if k not in ("task", "evaluation")})
    data.update(prompts_per_step=prompts_per_step, group_size=group,
                sampling=replace(data.get("sampling", Sampling()), max_new_tokens=max_new, temperature=1.0, top_p=1.0,
                                 dtype=PRECISIONS[precision][1]),
                prompt_format=replace(data.get("prompt_format", PromptFormat()), add_bos=False, use_chat_template=True))
    pairs = prompts(prompts_per_step * batches)
    return module, RolloutDataModule(task=common.listed_task(pairs), reward_fn=verifier(), **data)


def run_ours(workload: str, ckpt: Path, steps: int, warmup: int, prompts_per_step: int, group: int,
             max_new: int, equal_work: bool = False, precision: str = "fp32", micro_batch: int | None = None) -> dict:
    import torch

    spec = WORKLOADS[workload]
    counts = Counts()
    sizes: dict[str, int] = {}
    logged: list[dict[str, float]] = []
    mark = [(0, 0, 0, 0, 0)]

    def on_start(pl_module):
        counts.attach(pl_module.policy)
        sizes.update(linear_sizes(pl_module.policy))
        sizes["trainable"] = sum(p.numel() for p in pl_module.trainable_parameters())

    def on_batch(trainer, pl_module, batch):
        m = trainer.callback_metrics
        now = counts.snapshot()
        grad, nograd, head, generated, generated_head = (a - b for a, b in zip(now, mark[-1]))
        mark.append(now)
        logged.append({"tokens": float(batch.loss_mask.sum()), "skipped": float(m["train/skipped_rows"]),
                       "zero_std": float(m["train/zero_std_fraction"]), "reward": float(m["train/reward"]),
                       "prompt_tokens": float(batch.attention_mask[:, :batch.prompt_length].sum(1).float().mean()),
                       "update_time": float(m["perf/update_time"]), "rollout_time": float(m["perf/rollout_time"]),
                       "grad": grad, "nograd": nograd, "head": head, "generated": generated,
                       "generated_head": generated_head})

    module, datamodule = build_ours(workload, ckpt, prompts_per_step, group, max_new, equal_work, warmup + steps + 2,
                                    precision, micro_batch)
    before = matmul_rates()
    times = common.fit_ours(module, datamodule, warmup=warmup, steps=steps, on_batch=on_batch, on_start=on_start,
                            precision=PRECISIONS[precision][0])
    matmul = matmul_rates(before)
    n, per_step = len(logged), prompts_per_step * group
    timed = logged[warmup:]
    flops = [update_flops(sizes, spec["lora"], s["grad"], s["head"]) for s in timed]
    generation = [generation_flops(sizes, s["generated"], s["generated_head"]) for s in timed]
    return {
        "step_times": times, "peak_rss_mb": common.peak_mb(), "steps": n, "threads": torch.get_num_threads(),
        "completion_tokens": statistics.mean(s["tokens"] for s in logged),
        "zero_std_rows": statistics.mean(s["zero_std"] for s in logged) * per_step,
        "skipped_rows": statistics.mean(s["skipped"] for s in logged) * per_step,
        "reward": statistics.mean(s["reward"] for s in logged),
        "grad_positions": statistics.mean(s["grad"] for s in logged),
        "nograd_positions": statistics.mean(s["nograd"] for s in logged),
        "head_positions": statistics.mean(s["head"] for s in logged),
        "prompt_tokens": statistics.mean(s["prompt_tokens"] for s in logged),
        "trainable_params": sizes["trainable"], "sizes": sizes,
        "update_times": [s["update_time"] for s in timed], "rollout_times": [s["rollout_time"] for s in timed],
        "update_flops": flops, "update_flop_rates": [f / s["update_time"] for f, s in zip(flops, timed)],
        "generation_flops": generation,
        "generation_flop_rates": [f / s["rollout_time"] for f, s in zip(generation, timed)],
        "matmul_flops": matmul,
    }


# ---------------------------------------------------------------------------------------------- report
def own_rate(row: dict) -> str:
    """`` (bf16 X)``: a bf16 row's bf16 matmul GFLOP/s beside the fp32 one; nothing for fp32."""
    return f" (bf16 {row['bf16_matmul_flops'] / 1e9:.1f})" if row["precision"] == "bf16" else ""


def own_share(row: dict, what: str) -> str:
    """`` (bf16 X%)``: a bf16 row's ``what`` (update or generation) rate as a share of the bf16 matmul's."""
    return f" (bf16 {100 * row[f'own_{what}_fraction']:.0f}%)" if row["precision"] == "bf16" else ""


def main() -> None:
    p = common.parser(__doc__, "workloads", WORKLOADS, 2, "timed steps per run (after warm-up)")
    p.set_defaults(warmup=1)
    common.add_model_option(p)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-new", type=int, default=32, help="most new tokens per completion")
    common.add_run_options(p, "alternating ours/TRL runs per workload")
    p.add_argument("--equal-work", action="store_true",
                   help="our update forwards every row, as TRL's (no skipping of zero-variance groups' rows)")
    p.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=["fp32"],
                   help="run each workload in each (the module docstring's bf16)")
    p.add_argument("--micro-batch", type=int, help="both updates in micro-batches of this many rows")
    p.add_argument("--workload", choices=list(WORKLOADS), help=argparse.SUPPRESS)
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32", help=argparse.SUPPRESS)
    args = p.parse_args()
    ckpt = common.checkpoint_dir(args.model)

    if args.worker:  # a subprocess: train, print one JSON line
        run = run_trl if args.worker == "trl" else functools.partial(run_ours, equal_work=args.equal_work)
        common.worker_report(lambda: run(args.workload, ckpt, args.steps, args.warmup, args.prompts, args.group,
                                         args.max_new, precision=args.precision, micro_batch=args.micro_batch))
        return

    import importlib.metadata as md

    try:
        versions = ", ".join(f"{name} {md.version(name)}" for name in ("trl", "transformers", "peft", "accelerate"))
    except md.PackageNotFoundError as err:
        sys.exit(f"{err.name} is not installed: pip install -e '.[bench,lora]'")
    load = os.getloadavg()
    print(common.machine_line(f", load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, nice {os.nice(0)}"))
    print(f"versions: {versions}")
    code = subprocess.run(["git", "log", "-1", "--oneline"], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=False).stdout
    dirty = subprocess.run(["git", "status", "--short", "--", "rl_lightning"], cwd=REPO_ROOT, capture_output=True,
                           text=True, check=False).stdout.split()[1::2]
    print(f"code: {code.strip()}; uncommitted changes in: {', '.join(dirty) or 'none'}")
    print(f"model: {ckpt}; {args.prompts} prompts x G {args.group}, at most {args.max_new} new tokens; "
          f"{args.warmup} warm-up + {args.steps} timed steps per run; {args.repeats} alternating runs per framework "
          f"(ours first); {'equal work (ours skips no row)' if args.equal_work else 'ours skips inert rows'}"
          + (f"; updates in micro-batches of {args.micro_batch} rows" if args.micro_batch else ""))
    rows, everything = [], {}
    started = time.perf_counter()
    for workload, precision in ((w, p) for w in args.workloads for p in args.precisions):
        label = workload if args.precisions == ["fp32"] else f"{workload} {precision}"
        runs = common.alternate(
            __file__, ("ours", "trl"), args.repeats,
            ["--workload", workload, "--model", str(ckpt), "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--prompts", str(args.prompts), "--group", str(args.group), "--max-new", str(args.max_new),
             "--precision", precision, *(["--equal-work"] if args.equal_work else []),
             *(["--micro-batch", str(args.micro_batch)] if args.micro_batch else [])],
            label,
            lambda r: f" ({' '.join(f'{t:.1f}' for t in r['step_times'])}), peak RSS {r['peak_rss_mb']:.0f} MB, "
                      f"load {os.getloadavg()[0]:.2f}")
        row: dict[str, Any] = {"workload": label, "precision": precision}
        for worker, rs in runs.items():
            row[worker] = {"s_per_step": statistics.median(t for r in rs for t in r["step_times"]),
                           "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                           "trainable_params": rs[0]["trainable_params"]}
            for key in ("completion_tokens", "zero_std_rows", "skipped_rows", "reward", "grad_positions",
                        "nograd_positions", "head_positions", "prompt_tokens"):
                values = [r[key] for r in rs if r[key] is not None]
                row[worker][key] = statistics.mean(values) if values else None
        ours = runs["ours"]
        row["ours"]["update_s"] = statistics.median(t for r in ours for t in r["update_times"])
        row["ours"]["rollout_s"] = statistics.median(t for r in ours for t in r["rollout_times"])
        row["ours"]["update_flop_rate"] = statistics.median(f for r in ours for f in r["update_flop_rates"])
        row["ours"]["update_flops"] = statistics.median(f for r in ours for f in r["update_flops"])
        row["matmul_flops"] = max(r["matmul_flops"][0] for r in ours)  # fp32: the reference
        row["bf16_matmul_flops"] = max(r["matmul_flops"][1] for r in ours)
        own = row["bf16_matmul_flops"] if precision == "bf16" else row["matmul_flops"]  # the products' own dtype
        row["ours"]["generation_flop_rate"] = statistics.median(f for r in ours for f in r["generation_flop_rates"])
        row["ours"]["generation_flops"] = statistics.median(f for r in ours for f in r["generation_flops"])
        row["matmul_fraction"] = row["ours"]["update_flop_rate"] / row["matmul_flops"]
        row["generation_fraction"] = row["ours"]["generation_flop_rate"] / row["matmul_flops"]
        row["own_matmul_fraction"] = row["ours"]["update_flop_rate"] / own
        row["own_generation_fraction"] = row["ours"]["generation_flop_rate"] / own
        row["floor_s"] = (row["ours"]["update_flops"] + row["ours"]["generation_flops"]) / own
        row["floor_ratio"] = row["floor_s"] / row["trl"]["s_per_step"]
        row["ratio"] = row["ours"]["s_per_step"] / row["trl"]["s_per_step"]
        rows.append(row)
        everything[label] = runs

    common.print_step_summary(started, rows, decimals=1)
    print("\nWork per step (means over all steps): rows = prompts x G; prompt = mean prompt tokens; sampled = "
          "completion")
    print("tokens; zero-var = rows in zero-variance groups; skipped = rows the update did not forward; update fwd =")
    print("positions through the decoder with gradient; head fwd = positions through the LM head with gradient "
          "(not counted")
    print("for TRL: its fused_lm_head forward bypasses the module); prefill = positions through the decoder without "
          "gradient")
    print("in forwards of > 1 column:")
    common.print_table(
        ["workload", "framework", "trainable params", "rows", "prompt", "sampled", "mean reward", "zero-var rows",
         "skipped rows", "update fwd", "head fwd", "prefill"],
        ([r["workload"], name, f"{w['trainable_params']:,}", str(args.prompts * args.group),
          f"{w['prompt_tokens']:.1f}", f"{w['completion_tokens']:.0f}", f"{w['reward']:.3f}",
          f"{w['zero_std_rows']:.1f}", f"{w['skipped_rows']:.1f}", f"{w['grad_positions']:.0f}",
          f"{w['head_positions']:.0f}" if w["head_positions"] is not None else "(fused)",
          f"{w['nograd_positions']:.0f}"]
         for r in rows for name, w in (("TRL", r["trl"]), ("ours", r["ours"]))))
    print("\nOur update (medians over timed steps; FLOPs by the docstring's formula; matmul: best fp32 2048 x 2048 "
          "torch.matmul")
    print("in our workers, same thread count; a bf16 row also against the bf16 matmul's best):")
    common.print_table(
        ["workload", "ours rollout s", "ours update s", "update GFLOP", "update GFLOP/s", "matmul GFLOP/s",
         "of matmul", "generation GFLOP", "generation GFLOP/s", "of matmul"],
        ([r["workload"], f"{r['ours']['rollout_s']:.1f}", f"{r['ours']['update_s']:.1f}",
          f"{r['ours']['update_flops'] / 1e9:.0f}", f"{r['ours']['update_flop_rate'] / 1e9:.1f}",
          f"{r['matmul_flops'] / 1e9:.1f}" + own_rate(r), f"{100 * r['matmul_fraction']:.0f}%" + own_share(r, "matmul"),
          f"{r['ours']['generation_flops'] / 1e9:.0f}", f"{r['ours']['generation_flop_rate'] / 1e9:.1f}",
          f"{100 * r['generation_fraction']:.0f}%" + own_share(r, "generation")] for r in rows))
    for r in rows:
        print(f"{r['workload']}: update at {100 * r['matmul_fraction']:.0f}% and generation at "
              f"{100 * r['generation_fraction']:.0f}% of measured fp32 matmul throughput; arithmetic floor of our step "
              f"{r['floor_s']:.1f} s = {r['floor_ratio']:.2f} x TRL's step"
              + (" (at the bf16 matmul's rate)" if r["precision"] == "bf16" else ""))
    common.write_json(args.json, rows, everything)


if __name__ == "__main__":
    main()
