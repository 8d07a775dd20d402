"""Side-by-side GRPO step time: TRL's ``GRPOTrainer`` against rl_lightning's ``GRPO``, identical settings.

    .venv/bin/pip install -e '.[bench]'          # trl, accelerate, datasets (never runtime dependencies)
    .venv/bin/python experiments/bench_vs_trl.py [--sizes 1.1M 10.8M 50.6M] [--steps 6] [--warmup 2] [--repeats 2]
                                                 [--device cpu|cuda]

For each model size it builds one Llama config and one BPE tokenizer (vocab 512), saves a randomly
initialised checkpoint, and uses one prompt set and one reward function for both frameworks. Each
framework trains in its own subprocess (so each has its own peak memory); the subprocesses alternate
(TRL, ours, TRL, ours, ...) so machine noise hits both alike. The first ``--warmup`` steps of each run are
excluded. Settings shared by both: 8 prompts × G = 8, max 32 completion tokens, temperature 1, top-p 1,
fused AdamW lr 1e-5 (no weight decay; ``bench_common.adamw``), grad-norm clip 1.0, β = 0 (no reference model),
one update per batch, GRPO's seq-mean-token-mean loss (TRL ``loss_type="grpo"``), group std scaling, fp32, no gradient
checkpointing, no vLLM.

Printed per size: median s/step, completion tokens/s, peak memory (RSS on CPU, allocated GPU memory with
``--device cuda``) and the ratio ours/TRL; our step split into
rollout / reward / update (log-probs + loss + backward + step); and the "raw work" — sampling the same
number of tokens with the same engine plus one forward/backward of the same sequences — with our overhead
over it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import bench_common as common

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
        common.synchronize(device)
        start = time.perf_counter()
        for _ in range(5):
            a @ b
        common.synchronize(device)
        best = min(best, (time.perf_counter() - start) / 5)
    return flops, 2 * a.shape[0] * hidden * ffn / best


# ---------------------------------------------------------------------------------------------- workers
def run_trl(ckpt: Path, steps: int, warmup: int, device: str = "cpu") -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt)

    def reward(completions, **kwargs):  # noqa: ANN001, ANN003
        return [reward_value(c) for c in completions]

    times, log = common.train_trl(model, tok, reward, [{"prompt": p} for p in prompt_texts()],
                                  prompts=PROMPTS_PER_STEP, group=GROUP, max_new=MAX_NEW, lr=LR, warmup=warmup,
                                  steps=steps, device=device)
    # generated tokens per step, from TRL's own log (mean completion length x completions per step)
    lengths = [h["completions/mean_length"] for h in log if "completions/mean_length" in h]
    tokens = [m * PROMPTS_PER_STEP * GROUP for m in lengths][warmup:]
    return {"step_times": times, "tokens": tokens, "peak_rss_mb": common.peak_mb(device)}


def run_ours(ckpt: Path, steps: int, warmup: int, device: str = "cpu") -> dict:
    import torch

    from rl_lightning.algorithms import GRPO
    from rl_lightning.rollout import PromptFormat, RolloutDataModule, Sampling

    texts = prompt_texts()
    split: list[dict[str, float]] = []

    def on_batch(trainer, pl_module, batch):  # noqa: ANN001
        metrics = trainer.callback_metrics
        split.append({k: float(metrics[f"perf/{k}"]) for k in ("rollout_time", "reward_time", "update_time")}
                     | {"tokens": float(batch.loss_mask.sum())})

    module = GRPO(model_name_or_path=str(ckpt), loss_aggregation="seq_mean_token_mean", max_grad_norm=1.0,
                  optimizer=common.adamw(LR))
    datamodule = RolloutDataModule(task=common.listed_task([(t, None) for t in texts]),
                                   prompts_per_step=PROMPTS_PER_STEP, group_size=GROUP,
                                   reward_fn=common.function_reward(lambda prompt, response: reward_value(response)),
                                   sampling=Sampling(max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0),
                                   prompt_format=PromptFormat(add_bos=False))
    times = common.fit_ours(module, datamodule, warmup=warmup, steps=steps, on_batch=on_batch, device=device)
    result = {"step_times": times, "tokens": [s["tokens"] for s in split[warmup:]], "split": split[warmup:],
              "peak_rss_mb": common.peak_mb(device)}

    # The raw work: the same engine sampling the same number of prompts/tokens, plus one forward/backward.
    from rl_lightning.rollout import SamplingParams
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
        common.synchronize(device)
        t0 = time.perf_counter()
        policy.eval()
        gen = sample(policy, ids, mask, SamplingParams(MAX_NEW, tok.eos_token_id, tok.pad_token_id),
                     torch.Generator(device=device).manual_seed(0))
        policy.train()
        common.synchronize(device)
        t1 = time.perf_counter()
        full = torch.cat([ids, gen.response_ids], 1)
        attn = torch.cat([mask, gen.mask], 1)
        logits = policy(input_ids=full, attention_mask=attn).logits[:, width - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, gen.response_ids.unsqueeze(-1)).squeeze(-1)
        (-(logp * gen.mask).sum() / gen.mask.sum()).backward()
        policy.zero_grad(set_to_none=True)
        common.synchronize(device)
        raw.append({"sample": t1 - t0, "fwd_bwd": time.perf_counter() - t1, "tokens": float(gen.mask.sum())})
    result["raw"] = raw
    return result


# ---------------------------------------------------------------------------------------------- report
def summarise(runs: list[dict]) -> dict:
    times = [t for r in runs for t in r["step_times"]]
    toks = [t for r in runs for t in r["tokens"]]
    med = statistics.median(times)
    return {"s_per_step": med, "tok_per_s": statistics.median(toks) / med,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "n": len(times)}


def main() -> None:
    p = common.parser(__doc__, "sizes", SIZES, 6, "timed steps per run (after warm-up)")
    common.add_run_options(p, "alternating TRL/ours runs per size")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: both frameworks on the GPU (fp32, as on CPU); memory is then peak allocated")
    args = p.parse_args()

    if args.worker:  # a subprocess: train, print one JSON line
        run = run_trl if args.worker == "trl" else run_ours
        common.worker_report(lambda: run(args.ckpt, args.steps, args.warmup, args.device))
        return

    import torch

    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()} (both frameworks; fp32, as on CPU)")
    print(common.machine_line())
    print(f"settings: {PROMPTS_PER_STEP} prompts x G={GROUP}, max {MAX_NEW} new tokens, vocab {VOCAB}, fp32, "
          f"{args.warmup} warm-up + {args.steps} timed steps per run, {args.repeats} alternating runs per framework")
    table, everything = [], {}
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Path(tmp) / "ckpt"
            build_checkpoint(size, ckpt)
            _, peak_before = step_flops(ckpt, PROMPTS_PER_STEP * GROUP * MAX_NEW, args.device)
            runs = common.alternate(__file__, ("trl", "ours"), args.repeats, [
                "--ckpt", str(ckpt), "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
            ], size)
            tokens = statistics.median(t for r in runs["ours"] for t in r["tokens"])
            flops, peak = step_flops(ckpt, tokens, args.device)
            peak = max(peak, peak_before)
        trl, ours = summarise(runs["trl"]), summarise(runs["ours"])

        split = [s for r in runs["ours"] for s in r["split"]]
        raw = [s for r in runs["ours"] for s in r["raw"]]
        raw_s = statistics.median([r["sample"] + r["fwd_bwd"] for r in raw])
        row = {
            "size": size, "trl": trl, "ours": ours, "ratio": ours["s_per_step"] / trl["s_per_step"],
            "split": {k: statistics.median([s[k] for s in split])
                      for k in ("rollout_time", "reward_time", "update_time")},
            "raw": {"sample": statistics.median([r["sample"] for r in raw]),
                    "fwd_bwd": statistics.median([r["fwd_bwd"] for r in raw]), "total": raw_s},
        }
        row["overhead"] = ours["s_per_step"] / raw_s - 1.0
        row["flops"], row["peak"] = flops, peak
        table.append(row)
        everything[size] = runs

    memory = "peak GPU mem" if args.device == "cuda" else "peak RSS"
    print()
    common.print_table(
        ["model", "TRL s/step", "ours s/step", "ratio ours/TRL", "TRL tok/s", "ours tok/s", f"TRL {memory}",
         f"ours {memory}"],
        ([r["size"], f"{r['trl']['s_per_step']:.3f}", f"{r['ours']['s_per_step']:.3f}", f"{r['ratio']:.2f}",
          f"{r['trl']['tok_per_s']:.0f}", f"{r['ours']['tok_per_s']:.0f}", f"{r['trl']['peak_rss_mb']:.0f} MB",
          f"{r['ours']['peak_rss_mb']:.0f} MB"] for r in table))
    print("\nOur step, split (medians), and the raw work (same engine sampling + one forward/backward):")
    common.print_table(
        ["model", "rollout", "reward", "update", "raw sample", "raw fwd+bwd", "overhead over raw"],
        ([r["size"], *(f"{r['split'][k]:.3f} s" for k in ("rollout_time", "reward_time", "update_time")),
          f"{r['raw']['sample']:.3f} s", f"{r['raw']['fwd_bwd']:.3f} s", f"{100 * r['overhead']:+.0f}%"]
         for r in table))
    print("\nArithmetic floor: the least FLOPs a step needs (sampling forward + training forward/backward), the")
    print("speed each framework reached, and the time the step would take at this machine's best matrix-product speed:")
    common.print_table(
        ["model", "GFLOP/step", "peak GEMM GFLOP/s", "TRL GFLOP/s", "ours GFLOP/s", "floor s/step",
         "best possible ratio vs TRL"],
        ([r["size"], f"{r['flops'] / 1e9:.1f}", f"{r['peak'] / 1e9:.0f}",
          f"{r['flops'] / r['trl']['s_per_step'] / 1e9:.0f}", f"{r['flops'] / r['ours']['s_per_step'] / 1e9:.0f}",
          f"{r['flops'] / r['peak']:.3f}",
          f"{r['flops'] / r['peak'] / r['trl']['s_per_step']:.2f}"] for r in table))
    common.write_json(args.json, table, everything)


if __name__ == "__main__":
    main()
