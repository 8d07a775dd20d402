"""Rollout engines side by side: Hugging Face ``generate`` and the library's loop with its two savings on/off.

    .venv/bin/python experiments/bench_engines.py [--sizes 1.1M 10.8M 50.6M] [--repeats 5]

Same models as ``bench_vs_trl.py`` (random Llama checkpoints, BPE vocab 512), 64 rows (8 prompts x 8),
32 new tokens, temperature 1. Two length profiles:

* ``full``: the real EOS, which a random model almost never draws, so every row runs 32 tokens (the
  benchmark against TRL is this case);
* ``mixed``: the same model with a bias on EOS in its LM head, sized so that responses average ~12 tokens
  with a geometric spread up to 32 (like a long-tailed real rollout); this is where dropping finished rows
  matters.

Engines, timed alternately (median of ``--repeats``): ``HFGenerateEngine``; ``KVCacheEngine`` with neither
saving (the loop as it was); with ``drop_finished``; with ``static_cache``; with both (the default). Every
engine's tokens are checked against the default's for the same RNG state before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import GROUP, MAX_NEW, PROMPTS_PER_STEP, SIZES, build_checkpoint, prompt_texts  # noqa: E402

from rl_lightning.rollout import HFGenerateEngine, KVCacheEngine, SamplingParams  # noqa: E402

ENGINES = {
    "hf-generate": HFGenerateEngine(),
    "loop (neither)": KVCacheEngine(drop_finished=False, static_cache=False),
    "loop + drop": KVCacheEngine(drop_finished=True, static_cache=False),
    "loop + static": KVCacheEngine(drop_finished=False, static_cache=True),
    "loop + both (default)": KVCacheEngine(),
}


def prompts(tok) -> list[list[int]]:  # noqa: ANN001
    """The step's distinct prompts as token ids (each sampled ``GROUP`` times: ``n=GROUP``)."""
    return [tok(t, add_special_tokens=False)["input_ids"] for t in prompt_texts()[:PROMPTS_PER_STEP]]


def with_eos_bias(model, rows, params: SamplingParams, target: float = 12.0):  # noqa: ANN001
    """A copy of ``model`` whose LM head adds a bias to ``eos``, sized so the mean response is ~``target`` tokens."""
    import copy

    model = copy.deepcopy(model)
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    biased.weight = head.weight
    model.lm_head = biased
    low, high = 0.0, 20.0
    for _ in range(12):  # bisection on the bias: a larger bias ends responses sooner
        mid = (low + high) / 2
        with torch.no_grad():
            biased.bias.zero_()
            biased.bias[params.eos_token_id] = mid
        gen = KVCacheEngine().bound(model).generate(rows, replace(params, seed=0), n=GROUP)
        low, high = (mid, high) if gen.mask.sum(1).float().mean() > target else (low, mid)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {PROMPTS_PER_STEP * GROUP} rows, "
          f"max {MAX_NEW} new tokens, median of {args.repeats} alternating runs (s per rollout)")
    print("\n| model | lengths | mean length | " + " | ".join(ENGINES) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in ENGINES) + " |")
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Path(tmp) / "ckpt"
            build_checkpoint(size, ckpt)
            tok, model = AutoTokenizer.from_pretrained(ckpt), AutoModelForCausalLM.from_pretrained(ckpt).eval()
        rows = prompts(tok)
        params = SamplingParams(max_tokens=MAX_NEW, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for profile, profile_model in (("full", model), ("mixed", with_eos_bias(model, rows, params))):
            engines = {name: engine.bound(profile_model) for name, engine in ENGINES.items()}
            # every engine draws from the global RNG (seed None), re-seeded before each call
            torch.manual_seed(1)
            reference = engines["loop + both (default)"].generate(rows, params, n=GROUP)
            for name, engine in engines.items():
                torch.manual_seed(1)
                out = engine.generate(rows, params, n=GROUP)
                if not torch.equal(out.response_ids, reference.response_ids):
                    sys.exit(f"{name} drew different tokens than the default engine ({size}, {profile})")
            times: dict[str, list[float]] = {name: [] for name in ENGINES}
            for rep in range(args.repeats):
                for name, engine in engines.items():
                    torch.manual_seed(rep)
                    start = time.perf_counter()
                    engine.generate(rows, params, n=GROUP)
                    times[name].append(time.perf_counter() - start)
            length = float(reference.mask.sum(1).float().mean())
            cells = " | ".join(f"{statistics.median(t):.3f}" for t in times.values())
            print(f"| {size} | {profile} | {length:.1f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
