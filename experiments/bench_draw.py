"""The sampler's draw: ``torch.multinomial(p, 1)`` against ``rollout.generation.categorical_draw`` (the same index).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_draw.py [--repeats 20]

One decode step draws one token per running row from a ``[rows, vocab]`` table of probabilities. For each shape it
times both draws alternately on the same probabilities and generator state (so their indices must agree, which the
script checks) and prints the median milliseconds and their ratio. The shapes: the embedded tasks' vocabularies (99
and 1,000 entries) and SmolLM2's 49,152, at the row counts of this project's configs (32 and 64 rows a step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rl_lightning.rollout.generation import categorical_draw

SHAPES = [(64, 99), (128, 1000), (32, 49152), (64, 49152)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="timed draws per method and shape")
    args = parser.parse_args()
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
