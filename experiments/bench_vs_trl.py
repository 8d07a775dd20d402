"""Side-by-side GRPO step time: TRL's ``GRPOTrainer`` against rl_lightning's ``GRPO``, identical settings.

    .venv/bin/pip install -e '.[bench]'          # trl, accelerate, datasets (never runtime dependencies)
    .venv/bin/python experiments/bench_vs_trl.py [--sizes 1.1M 10.8M 50.6M] [--steps 6] [--warmup 2] [--repeats 2]
                                                 [--device cpu|cuda]

For each model size it builds one Llama config and one BPE tokenizer (vocab 512), saves a randomly
initialised checkpoint, and uses one prompt set and one reward function for both frameworks. Each
framework trains in its own subprocess (so each has its own peak memory); the subprocesses alternate
(TRL, ours, TRL, ours, ...) so machine noise hits both alike. The first ``--warmup`` steps of each run are
excluded. Settings shared by both: 8 prompts × G = 8, max 32 completion tokens, temperature 1, top-p 1,
AdamW lr 1e-5 (no weight decay), grad-norm clip 1.0, β = 0 (no reference model), one update per batch,
GRPO's seq-mean-token-mean loss (TRL ``loss_type="grpo"``), group std scaling, fp32, no gradient
checkpointing, no vLLM.

Printed per size: median s/step, completion tokens/s, peak memory (RSS on CPU, allocated GPU memory with
``--device cuda``) and the ratio ours/TRL; our step split into
rollout / reward / update (log-probs + loss + backward + step); and the "raw work" — sampling the same
number of tokens with the same engine plus one forward/backward of the same sequences — with our overhead
over it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

SIZES = {  # name: (hidden, layers, heads, ffn)
    "1.1M": (128, 4, 4, 512),
    "10.8M": (384, 6, 6, 1024),
    "50.6M": (512, 12, 8, 2048),
}
PROMPTS_PER_STEP, GROUP, MAX_NEW, LR, VOCAB = 8, 8, 32, 1e-5, 512


def prompt_texts(n: int = 512) -> list[str]:
    import random

    rng = random.Random(0)
    return [f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=" for _ in range(n)]


def reward_value(completion: str) -> float:
    """The shared reward: the fraction of characters that are digits (cheap, and it varies within a group)."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


# ---------------------------------------------------------------------------------------------- setup
def build_checkpoint(size: str, out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    import torch

    corpus = prompt_texts(4000) + [" ".join(prompt_texts(20)) for _ in range(200)]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    from tokenizers import decoders

    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>", padding_side="left")
    hidden, layers, heads, ffn = SIZES[size]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, intermediate_size=ffn, max_position_embeddings=128,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def step_flops(ckpt: Path, completion_tokens: float, device: str = "cpu") -> tuple[float, float]:
    """``(FLOPs, peak GEMM FLOP/s)``: the least arithmetic any framework must do per step, and this machine's speed.

    Per step: sample ``completion_tokens`` (a forward per token, plus the prompt forward) and one
    forward/backward (3 forwards' worth) of prompt + completion; 2 FLOPs per weight of every linear layer
    (the LM head included, embeddings are lookups) per token, attention's ``QK^T`` and ``AV`` added. The peak is
    the best of ten timings of the update's largest matrix product ``[rows*len, hidden] x [hidden, ffn]``
    (the caller takes the best of two such measurements, before and after the runs: on a shared machine a
    single measurement can land in a slow moment and understate the peak).
    """
    import torch
    from transformers import AutoConfig, AutoTokenizer

    config, tok = AutoConfig.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt)
    hidden, layers, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    linear = layers * (4 * hidden * hidden + 3 * hidden * ffn) + hidden * config.vocab_size
    rows = PROMPTS_PER_STEP * GROUP
    prompt = statistics.mean(len(tok(t, add_special_tokens=False)["input_ids"]) for t in prompt_texts())
    length = prompt + completion_tokens / rows
    per_token = 2 * linear + 4 * layers * hidden * length / 2  # attention over on average half the sequence
    flops = rows * length * per_token * (1 + 3)  # sampling forward + training forward/backward
    a = torch.randn(int(rows * length), hidden, device=device)
    b = torch.randn(hidden, ffn, device=device)
    best = float("inf")
    for _ in range(10):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(5):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / 5)
    return flops, 2 * a.shape[0] * hidden * ffn / best


def peak_mb(device: str = "cpu") -> float:
    """Peak resident memory of this process (CPU) or peak allocated GPU memory (CUDA), in MB."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ---------------------------------------------------------------------------------------------- workers
def run_trl(ckpt: Path, steps: int, warmup: int, device: str = "cpu") -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    ends: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
            synchronize(device)
            ends.append(time.perf_counter())

    def reward(completions, **kwargs):  # noqa: ANN001, ANN003
        return [reward_value(c) for c in completions]

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=device == "cpu", bf16=False, fp16=False, gradient_checkpointing=False,
            per_device_train_batch_size=PROMPTS_PER_STEP * GROUP, num_generations=GROUP,
            max_completion_length=MAX_NEW, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="grpo",
            scale_rewards="group", num_iterations=1, learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0,
            lr_scheduler_type="constant", warmup_steps=0, max_steps=warmup + steps, report_to="none",
            logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                              train_dataset=Dataset.from_list([{"prompt": p} for p in prompt_texts()]),
                              callbacks=[Timer()])
        start = time.perf_counter()
        trainer.train()
    marks = [start, *ends]
    times = [b - a for a, b in zip(marks, marks[1:])][warmup:]
    # generated tokens per step, from TRL's own log (mean completion length x completions per step)
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    tokens = [m * PROMPTS_PER_STEP * GROUP for m in lengths][warmup:]
    return {"step_times": times, "tokens": tokens, "peak_rss_mb": peak_mb(device)}


def run_ours(ckpt: Path, steps: int, warmup: int, device: str = "cpu") -> dict:
    import torch
    from lightning.pytorch import Callback, Trainer

    from rl_lightning.algorithms import GRPO
    from rl_lightning.envs import Prompt, RewardFunction, Task
    from rl_lightning.rollout import RolloutDataModule

    texts = prompt_texts()

    class Prompts(Task):
        def train_prompt(self, index: int) -> Prompt:
            return Prompt(texts[index % len(texts)])

        def heldout_prompts(self) -> list[Prompt]:
            return []

    class DigitReward(RewardFunction):
        def __call__(self, prompt: Prompt, response: str) -> float:
            return reward_value(response)

    ends: list[float] = []
    split: list[dict[str, float]] = []

    class Timer(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            synchronize(device)
            ends.append(time.perf_counter())
            metrics = trainer.callback_metrics
            split.append({k: float(metrics[f"perf/{k}"]) for k in ("rollout_time", "reward_time", "update_time")}
                         | {"tokens": float(batch.loss_mask.sum())})

    module = GRPO(model_name_or_path=str(ckpt), loss_aggregation="seq_mean_token_mean", max_grad_norm=1.0,
                  optimizer=lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.0))
    datamodule = RolloutDataModule(task=Prompts(), prompts_per_step=PROMPTS_PER_STEP, group_size=GROUP,
                                   max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0, reward_fn=DigitReward(),
                                   add_bos=False)
    trainer = Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=warmup + steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer()])
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    marks = [start, *ends]
    times = [b - a for a, b in zip(marks, marks[1:])][warmup:]
    result = {"step_times": times, "tokens": [s["tokens"] for s in split[warmup:]], "split": split[warmup:],
              "peak_rss_mb": peak_mb(device)}

    # The raw work: the same engine sampling the same number of prompts/tokens, plus one forward/backward.
    from rl_lightning.rollout.generation import sample

    tok, policy = module.tokenizer, module.policy
    rows = [tok(texts[i % len(texts)], add_special_tokens=False)["input_ids"]
            for i in range(PROMPTS_PER_STEP) for _ in range(GROUP)]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width).unsqueeze(0) >= (width - torch.tensor([len(r) for r in rows])).unsqueeze(1)).long()
    ids, mask, policy = ids.to(device), mask.to(device), policy.to(device)
    raw = []
    for _ in range(3):
        synchronize(device)
        t0 = time.perf_counter()
        policy.eval()
        gen = sample(policy, ids, mask, MAX_NEW, tok.eos_token_id, tok.pad_token_id,
                     generator=torch.Generator(device=device).manual_seed(0))
        policy.train()
        synchronize(device)
        t1 = time.perf_counter()
        full = torch.cat([ids, gen.response_ids], 1)
        attn = torch.cat([mask, gen.mask], 1)
        logits = policy(input_ids=full, attention_mask=attn).logits[:, width - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, gen.response_ids.unsqueeze(-1)).squeeze(-1)
        (-(logp * gen.mask).sum() / gen.mask.sum()).backward()
        policy.zero_grad(set_to_none=True)
        synchronize(device)
        raw.append({"sample": t1 - t0, "fwd_bwd": time.perf_counter() - t1, "tokens": float(gen.mask.sum())})
    result["raw"] = raw
    return result


# ---------------------------------------------------------------------------------------------- report
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


def summarise(runs: list[dict]) -> dict:
    times = [t for r in runs for t in r["step_times"]]
    toks = [t for r in runs for t in r["tokens"]]
    med = statistics.median(times)
    return {"s_per_step": med, "tok_per_s": statistics.median(toks) / med,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "n": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="alternating TRL/ours runs per size")
    parser.add_argument("--worker", choices=["trl", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: both frameworks on the GPU (fp32, as on CPU); memory is then peak allocated")
    args = parser.parse_args()

    if args.worker:  # a subprocess: train, print one JSON line
        run = run_trl if args.worker == "trl" else run_ours
        worker_report(lambda: run(args.ckpt, args.steps, args.warmup, args.device))
        return

    import platform

    import torch

    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()} (both frameworks; fp32, as on CPU)")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), python {platform.python_version()}")
    print(f"settings: {PROMPTS_PER_STEP} prompts x G={GROUP}, max {MAX_NEW} new tokens, vocab {VOCAB}, fp32, "
          f"{args.warmup} warm-up + {args.steps} timed steps per run, {args.repeats} alternating runs per framework")
    table, everything = [], {}
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Path(tmp) / "ckpt"
            build_checkpoint(size, ckpt)
            runs: dict[str, list[dict]] = {"trl": [], "ours": []}
            _, peak_before = step_flops(ckpt, PROMPTS_PER_STEP * GROUP * MAX_NEW, args.device)
            for _ in range(args.repeats):
                for worker in ("trl", "ours"):
                    runs[worker].append(run_worker(__file__, [
                        "--worker", worker, "--ckpt", str(ckpt), "--steps", str(args.steps), "--warmup",
                        str(args.warmup), "--device", args.device], f"{worker} run for {size}"))
                    print(f"  {size} {worker}: median {statistics.median(runs[worker][-1]['step_times']):.3f} s/step",
                          flush=True)
            tokens = statistics.median(t for r in runs["ours"] for t in r["tokens"])
            flops, peak = step_flops(ckpt, tokens, args.device)
            peak = max(peak, peak_before)
        trl, ours = summarise(runs["trl"]), summarise(runs["ours"])

        split = [s for r in runs["ours"] for s in r["split"]]
        raw = [s for r in runs["ours"] for s in r["raw"]]
        raw_s = statistics.median([r["sample"] + r["fwd_bwd"] for r in raw])
        row = {
            "size": size, "trl": trl, "ours": ours, "ratio": ours["s_per_step"] / trl["s_per_step"],
            "split": {k: statistics.median([s[k] for s in split]) for k in ("rollout_time", "reward_time", "update_time")},
            "raw": {"sample": statistics.median([r["sample"] for r in raw]),
                    "fwd_bwd": statistics.median([r["fwd_bwd"] for r in raw]), "total": raw_s},
        }
        row["overhead"] = ours["s_per_step"] / raw_s - 1.0
        row["flops"], row["peak"] = flops, peak
        table.append(row)
        everything[size] = runs

    memory = "peak GPU mem" if args.device == "cuda" else "peak RSS"
    print(f"\n| model | TRL s/step | ours s/step | ratio ours/TRL | TRL tok/s | ours tok/s | TRL {memory} | ours {memory} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        t, o = r["trl"], r["ours"]
        print(f"| {r['size']} | {t['s_per_step']:.3f} | {o['s_per_step']:.3f} | {r['ratio']:.2f} | "
              f"{t['tok_per_s']:.0f} | {o['tok_per_s']:.0f} | {t['peak_rss_mb']:.0f} MB | {o['peak_rss_mb']:.0f} MB |")
    print("\nOur step, split (medians), and the raw work (same engine sampling + one forward/backward):")
    print("| model | rollout | reward | update | raw sample | raw fwd+bwd | overhead over raw |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        s, w = r["split"], r["raw"]
        print(f"| {r['size']} | {s['rollout_time']:.3f} s | {s['reward_time']:.3f} s | {s['update_time']:.3f} s | "
              f"{w['sample']:.3f} s | {w['fwd_bwd']:.3f} s | {100 * r['overhead']:+.0f}% |")
    print("\nArithmetic floor: the least FLOPs a step needs (sampling forward + training forward/backward), the")
    print("speed each framework reached, and the time the step would take at this machine's best matrix-product speed:")
    print("| model | GFLOP/step | peak GEMM GFLOP/s | TRL GFLOP/s | ours GFLOP/s | floor s/step | best possible ratio vs TRL |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        floor = r["flops"] / r["peak"]
        print(f"| {r['size']} | {r['flops'] / 1e9:.1f} | {r['peak'] / 1e9:.0f} | "
              f"{r['flops'] / r['trl']['s_per_step'] / 1e9:.0f} | {r['flops'] / r['ours']['s_per_step'] / 1e9:.0f} | "
              f"{floor:.3f} | {floor / r['trl']['s_per_step']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"table": table, "runs": everything}, indent=1))


if __name__ == "__main__":
    main()
