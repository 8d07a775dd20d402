"""Next-token log-probs over candidate ids at given contexts: ``candidate_logprobs`` (one forward row per context)
against the ``score_sequences`` path (one row per context and candidate; issue 22, item 3).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_candidates.py [--contexts 64] [--candidates 11] [--repeats 20]

The embedded guess model (1.1M parameters, 64 positions), contexts of guess-the-number episodes (14-30 tokens) and
the 11 value tokens "0".."9" + EOS; timed with the gradient (forward + backward of the log-probs' sum, as a critic
loss) and without, alternating the two paths after one untimed warm-up each. Prints the medians and the largest
difference between the two results.

Measured (x86_64, 2 busy CPU cores, 1 thread, 10 repeats; ``score_sequences`` already runs each context once for
its 11 rows through the shared prompt forward):

    no gradient: candidate_logprobs 122.3 ms, score_sequences 270.9 ms; max |diff| 1.91e-06
    with gradient: candidate_logprobs 333.4 ms, score_sequences 684.7 ms; max |diff| 1.91e-06
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, default=64)
    parser.add_argument("--candidates", type=int, default=11)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from rl_lightning.algorithms import GRPO

    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:guess")
    tok = module.tokenizer
    rng = random.Random(0)
    contexts = []
    for _ in range(args.contexts):
        turns = rng.randint(1, 4)
        text = "guess 1-31:" + "".join(f"{rng.randint(1, 31)}\n{rng.choice(['hi:', 'lo:'])}" for _ in range(turns))
        contexts.append([tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]])
    grid = ([tok(str(d), add_special_tokens=False)["input_ids"][0] for d in range(10)] + [tok.eos_token_id])
    grid = grid[: args.candidates]
    pairs = [(c, [g]) for c in contexts for g in grid]

    def fast(grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            out = module.candidate_logprobs(contexts, grid)
            if grad:
                out.sum().backward()
        return out.detach()

    def slow(grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            out, _ = module.score_sequences([c for c, _ in pairs], [t for _, t in pairs])
            logp = out.logprobs[:, 0].reshape(len(contexts), len(grid))
            if grad:
                logp.sum().backward()
        return logp.detach()

    print(f"{len(contexts)} contexts x {len(grid)} candidates, torch threads {torch.get_num_threads()}")
    for grad in (False, True):
        times: dict[str, list[float]] = {"candidate_logprobs": [], "score_sequences": []}
        paths = {"candidate_logprobs": fast, "score_sequences": slow}
        results = {name: fn(grad) for name, fn in paths.items()}  # warm-up
        for repeat in range(args.repeats):
            for name in (list(paths) if repeat % 2 == 0 else list(paths)[::-1]):
                module.policy.zero_grad(set_to_none=True)
                start = time.perf_counter()
                paths[name](grad)
                times[name].append(time.perf_counter() - start)
        diff = float((results["candidate_logprobs"] - results["score_sequences"]).abs().max())
        line = ", ".join(f"{name} {statistics.median(t) * 1e3:.1f} ms" for name, t in times.items())
        print(f"{'with' if grad else 'no'} gradient: {line}; max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
