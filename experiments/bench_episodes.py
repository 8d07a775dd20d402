"""Multi-turn rollout throughput: the KV cache carried over from turn to turn vs re-running the history.

    .venv/bin/python experiments/bench_episodes.py [--episodes 64] [--turns 6] [--turn-tokens 8] [--obs-tokens 8]
        [--repeats 5]

Episodes of a scripted environment (every turn answered by a fixed-length observation, never ending before
``--turns``) are sampled from a random tiny Llama (hidden 128 and 384, the embedded default's architecture and
the 10.8M one of bench_vs_trl.py) in ``KVCacheEngine`` sessions, ``sample_episodes(carry_cache=True)`` and
``(carry_cache=False)``,
alternating, ``--repeats`` times each; the draws are the same, so both produce the same tokens. Prints
tokens per second (sampled + observation tokens) and the ratio, per size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from rl_lightning.models.policy import build_tiny_policy  # noqa: E402
from rl_lightning.rollout import KVCacheEngine, SamplingParams, sample_episodes  # noqa: E402


def run(model, tok, args, carry: bool, seed: int) -> tuple[float, int, torch.Tensor]:  # noqa: ANN001
    obs = tok("x" * args.obs_tokens, add_special_tokens=False)["input_ids"]
    prompts = [[tok.bos_token_id, *tok(f"{i % 90 + 10}+{i % 7}=", add_special_tokens=False)["input_ids"]]
               for i in range(args.episodes)]
    eos = len(tok) + 7  # an id the model never samples: every turn runs to --turn-tokens

    def observe(rows, actions):  # noqa: ANN001, ANN202
        return [list(obs) for _ in rows]

    params = SamplingParams(max_tokens=args.turn_tokens, eos_token_id=eos, pad_token_id=tok.pad_token_id, seed=seed)
    start = time.perf_counter()
    out = sample_episodes(KVCacheEngine().bound(model), prompts, observe, params=params, max_turns=args.turns,
                          max_episode_tokens=args.turns * (args.turn_tokens + args.obs_tokens) + 1,
                          carry_cache=carry)
    seconds = time.perf_counter() - start
    tokens = int((out.mask + out.obs_mask).sum())
    return seconds, tokens, out.response_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--turn-tokens", type=int, default=8)
    parser.add_argument("--obs-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    context = 10 + args.turns * (args.turn_tokens + args.obs_tokens)
    print(f"{args.episodes} episodes x {args.turns} turns x ({args.turn_tokens} sampled + {args.obs_tokens} observed) "
          f"tokens, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for hidden, layers, heads, ffn in ((128, 4, 4, 512), (384, 6, 6, 1024)):
        model, tok = build_tiny_policy(hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=ffn,
                                       max_position_embeddings=max(64, context + 8))
        model.eval()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        times: dict[bool, list[float]] = {True: [], False: []}
        ids: dict[bool, torch.Tensor] = {}
        tokens = 0
        run(model, tok, args, True, 0)  # warm-up
        for r in range(args.repeats):
            for carry in (True, False) if r % 2 == 0 else (False, True):
                seconds, tokens, ids[carry] = run(model, tok, args, carry, seed=r)
                times[carry].append(seconds)
        same = torch.equal(ids[True], ids[False])
        carried, again = statistics.median(times[True]), statistics.median(times[False])
        print(f"{params:.1f}M params: carried cache {tokens / carried:,.0f} tok/s ({carried:.3f} s), "
              f"re-encoded history {tokens / again:,.0f} tok/s ({again:.3f} s); speed-up x{again / carried:.2f}; "
              f"same tokens: {same}")


if __name__ == "__main__":
    main()
