"""The sampler's draw: ``torch.multinomial(p, 1)`` against ``rollout.generation.categorical_draw`` (the same index).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_draw.py [--repeats 20]
    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_draw.py --rollout ~/.cache/rl_lightning/SmolLM2-135M-Instruct

One decode step draws one token per running row from a ``[rows, vocab]`` table of probabilities. For each shape it
times both draws alternately on the same probabilities and generator state (so their indices must agree, which the
script checks) and prints the median milliseconds and their ratio. The shapes: the embedded tasks' vocabularies (99
and 1,000 entries) and SmolLM2's 49,152, at the row counts of this project's configs (32 and 64 rows a step).

``--rollout DIR`` times whole rollouts instead: the local checkpoint ``DIR`` samples ``--rows`` rows (``--rows / 8``
word problems in its chat template, 8 rows each) of at most ``--tokens`` new tokens with ``KVCacheEngine``'s loop,
alternately with ``categorical_draw`` and with ``torch.multinomial`` in its place, ``--repeats`` pairs with the same
seed per pair (the script checks that each pair drew the same tokens and log-probs).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from unittest import mock

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as common

from rl_lightning.rollout import generation
from rl_lightning.rollout.generation import categorical_draw

SHAPES = [(64, 99), (128, 1000), (32, 49152), (64, 49152)]


def rollouts(model_dir: Path, rows: int, tokens: int, repeats: int) -> None:
    """Whole rollouts, alternating the two draws (the module docstring's ``--rollout``)."""
    from rl_lightning.models.policy import load_policy
    from rl_lightning.rollout import SamplingParams

    model, tok = load_policy(str(model_dir))
    model.eval()
    ids, mask = common.chat_prompt_batch(tok, rows)
    params = SamplingParams(max_tokens=tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)

    def multinomial(p, g=None):  # noqa: ANN001, ANN202
        return torch.multinomial(p, 1, generator=g).squeeze(-1)

    ways = {"categorical_draw": (model, contextlib.nullcontext),
            "multinomial": (model, lambda: mock.patch.object(generation, "categorical_draw", multinomial))}
    print(f"{model_dir}: {ids.shape[0]} rows, prompts of {ids.shape[1]} tokens, at most {tokens} new tokens; "
          f"{repeats} alternating pairs")

    def after_round(repeat: int, out: dict, times: dict) -> None:
        a, b = out["categorical_draw"], out["multinomial"]
        if not (torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)):
            raise SystemExit(f"pair {repeat}: the two draws gave different rollouts")
        print(f"  pair {repeat}: categorical_draw {times['categorical_draw'][-1]:.2f} s, multinomial "
              f"{times['multinomial'][-1]:.2f} s, {int(a.mask.sum())} tokens")

    times = common.alternate_rollouts(ways, ids, mask, params, repeats, after_round)
    a, b = statistics.median(times["categorical_draw"]), statistics.median(times["multinomial"])
    print(f"median: categorical_draw {a:.2f} s, multinomial {b:.2f} s, ratio {a / b:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="timed draws (or rollout pairs) per method and shape")
    parser.add_argument("--rollout", type=Path, help="a local checkpoint directory: time whole rollouts on it")
    parser.add_argument("--rows", type=int, default=32, help="--rollout: rows (8 per prompt)")
    parser.add_argument("--tokens", type=int, default=32, help="--rollout: most new tokens per row")
    args = parser.parse_args()
    if args.rollout is not None:
        rollouts(args.rollout.expanduser(), args.rows, args.tokens, args.repeats)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); median of {args.repeats} alternating draws")
    print("| rows x vocab | torch.multinomial ms | categorical_draw ms | ratio |")
    print("| --- | --- | --- | --- |")
    for rows, vocab in SHAPES:
        probs = torch.softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
        times: dict[str, list[float]] = {"multinomial": [], "categorical_draw": []}
        for repeat in range(args.repeats + 1):  # the first round is a warm-up
            drawn = []
            for name, fn in (("multinomial", lambda g: torch.multinomial(probs, 1, generator=g).squeeze(-1)),
                             ("categorical_draw", lambda g: categorical_draw(probs, g))):
                generator = torch.Generator().manual_seed(repeat)
                start = time.perf_counter()
                drawn.append(fn(generator))
                if repeat:
                    times[name].append(1e3 * (time.perf_counter() - start))
            if not torch.equal(drawn[0], drawn[1]):
                raise SystemExit(f"{rows} x {vocab}: the two draws differ (seed {repeat})")
        a, b = statistics.median(times["multinomial"]), statistics.median(times["categorical_draw"])
        print(f"| {rows} x {vocab:,} | {a:.2f} | {b:.2f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
