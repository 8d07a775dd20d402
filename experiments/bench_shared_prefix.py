"""Update and generation time with and without the shared prompt forward (issue 14, item 1).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_shared_prefix.py [--repeats 5] [--long-repeats 3]
        [--long-prompts 8] [--skip-long]

Two workloads, G = 8 responses per prompt:

* ``embedded``: the shipped GRPO config (``configs/grpo.yaml``: the embedded 1.1M warm start, 16 prompts x 8 =
  128 rows, BOS + ``"37+48="``-style prompts of 7 tokens, at most 6 answer tokens), on its real rollouts;
* ``long``: the 10.8M Llama of ``experiments/bench_vs_trl.py`` (its model and BPE tokenizer, random weights) with
  a fixed 200-token instruction block before each ``"a+b="`` prompt (~205 prompt tokens), ``--long-prompts`` x 8
  rows, up to 32 completion tokens sampled from the random model.

Timed, alternating plain/shared (the order flips every repeat) after one untimed warm-up of each:

* ``update``: ``RLModule.update`` (GRPO, the config's settings, a real AdamW; weights restored before each, untimed)
  with ``share_prompt_forward`` off/on, for ``micro_batch_size`` null (the configs' default: the whole batch in one
  forward) and ``G`` (with length bucketing, which mixes groups: partial sharing);
* ``generate``: ``generation.sample`` (the KV-cache engine, static decode) with ``share_prefill`` off/on, the same
  generator seed; the tokens must be identical.

Prints the medians, the ratio shared/plain and the largest gradient difference relative to the largest gradient
entry (the update must be the same).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "experiments"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

from rl_lightning.algorithms import GRPO  # noqa: E402
from rl_lightning.rollout import RolloutBatch  # noqa: E402
from rl_lightning.rollout import SamplingParams  # noqa: E402
from rl_lightning.rollout.generation import DecodeOptions, sample  # noqa: E402
from bench_skipping import _config, _module, _Optimizer, real_batches  # noqa: E402  (same directory)

GROUP, LONG_NEW, INSTRUCTION_TOKENS = 8, 32, 200
INSTRUCTION = ("You are a careful calculator. Read the two numbers below, add them digit by digit from the right, "
               "carry when a column sums to ten or more, and write only the final sum, with no spaces, no words "
               "and no explanation, then stop. ") * 4


def long_checkpoint(out: Path) -> Path:
    """bench_vs_trl's 10.8M Llama checkpoint, with room for ~240 positions."""
    from bench_vs_trl import build_checkpoint

    build_checkpoint("10.8M", out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (out / "config.json").write_text(json.dumps(config))
    return out


def long_prompts(module: GRPO, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[count * G, P]`` left-padded ids/mask: BOS + the 200-token instruction + a ``"a+b="`` prompt, G rows each."""
    from bench_vs_trl import prompt_texts

    tok = module.tokenizer
    block = tok(INSTRUCTION, add_special_tokens=False)["input_ids"][:INSTRUCTION_TOKENS]
    assert len(block) == INSTRUCTION_TOKENS, len(block)
    rows = [[tok.bos_token_id, *block, *tok(text, add_special_tokens=False)["input_ids"]]
            for text in prompt_texts(count)]
    width = max(len(r) for r in rows)
    ids = torch.full((count, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((count, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return ids.repeat_interleave(GROUP, 0), mask.repeat_interleave(GROUP, 0)


def generate(module: GRPO, ids: torch.Tensor, mask: torch.Tensor, max_new: int, share: bool, seed: int = 0):  # noqa: ANN201
    tok = module.tokenizer
    module.policy.eval()
    try:
        return sample(module.policy, ids, mask, SamplingParams(max_new, tok.eos_token_id, tok.pad_token_id),
                      torch.Generator().manual_seed(seed), options=DecodeOptions(share_prefill=share))
    finally:
        module.policy.train()


def long_batch(module: GRPO, ids: torch.Tensor, mask: torch.Tensor) -> RolloutBatch:
    gen = generate(module, ids, mask, LONG_NEW, share=True)
    rewards = torch.randint(0, 2, (ids.shape[0],), generator=torch.Generator().manual_seed(0)).float()
    return RolloutBatch.from_generation(ids, mask, gen, rewards=rewards, group_size=GROUP,
                                        prompt_index=torch.arange(ids.shape[0]) // GROUP, temperature=1.0, top_p=1.0)


def timed_update(module: GRPO, batches: list[RolloutBatch], state: dict, lr: float) -> tuple[float, list[torch.Tensor]]:
    """Seconds of ``update`` over ``batches`` (weights restored before each) and the first batch's gradient."""
    seconds, grads = 0.0, []
    for i, batch in enumerate(batches):
        module.load_state_dict(state)
        optimizer = _Optimizer(torch.optim.AdamW(module.policy.parameters(), lr=lr, weight_decay=0.0))
        module.optimizers = lambda: optimizer  # type: ignore[method-assign]
        step = optimizer.optimizer.step
        if i == 0:
            def capture_and_step() -> None:
                grads.extend(p.grad.clone() for p in module.policy.parameters())
                step()
            optimizer.step = capture_and_step  # type: ignore[method-assign]
        start = time.perf_counter()
        advantages = module.compute_advantages(batch).detach().unsqueeze(-1)
        module.update(batch, advantages, module.loss_weights(batch))
        seconds += time.perf_counter() - start
    return seconds, grads


def alternate(repeats: int, run) -> dict[bool, list]:  # noqa: ANN001
    """``run(share)`` for share in (False, True), one warm-up each, then ``repeats`` alternating rounds."""
    results: dict[bool, list] = {False: [], True: []}
    run(False), run(True)
    for r in range(repeats):
        for share in ((False, True) if r % 2 == 0 else (True, False)):
            results[share].append(run(share))
    return results


def bench_update(name: str, module: GRPO, batches: list[RolloutBatch], repeats: int, lr: float) -> None:
    state = {k: v.clone() for k, v in module.state_dict().items()}
    for micro in (None, GROUP):
        module.micro_batch_size = micro

        def run(share: bool) -> tuple[float, list[torch.Tensor]]:
            module.share_prompt_forward = share
            return timed_update(module, batches, state, lr)
        results = alternate(repeats, run)
        plain, shared = (statistics.median(s for s, _ in results[k]) / len(batches) for k in (False, True))
        ref, got = results[False][-1][1], results[True][-1][1]
        scale = max(float(g.abs().max()) for g in ref)
        worst = max(float((a - b).abs().max()) for a, b in zip(got, ref)) / scale
        label = "null" if micro is None else f"{micro} (bucketing)"
        print(f"  [{name}] update, micro_batch_size {label:<15} plain {plain * 1000:8.1f} ms   shared "
              f"{shared * 1000:8.1f} ms   x{shared / plain:.2f}   max|Δgrad|/max|grad| {worst:.1e}")
    module.load_state_dict(state)


def bench_generate(name: str, module: GRPO, prompts: list[tuple[torch.Tensor, torch.Tensor]], max_new: int,
                   repeats: int) -> None:
    def run(share: bool) -> tuple[float, list]:
        start = time.perf_counter()
        gens = [generate(module, ids, mask, max_new, share, seed=i) for i, (ids, mask) in enumerate(prompts)]
        return time.perf_counter() - start, gens
    results = alternate(repeats, run)
    plain, shared = (statistics.median(s for s, _ in results[k]) / len(prompts) for k in (False, True))
    same = all(torch.equal(a.response_ids, b.response_ids) and torch.equal(a.mask, b.mask)
               for a, b in zip(results[False][-1][1], results[True][-1][1]))
    diff = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(results[False][-1][1],
                                                                           results[True][-1][1]))
    print(f"  [{name}] generate ({max_new} new tokens)             plain {plain * 1000:8.1f} ms   shared "
          f"{shared * 1000:8.1f} ms   x{shared / plain:.2f}   same tokens: {same}, max|Δlogp| {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="real rollout batches of the embedded workload")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long-repeats", type=int, default=3, help="repeats of the (slow) long workload")
    parser.add_argument("--long-prompts", type=int, default=8, help="prompts of the long workload (x G rows)")
    parser.add_argument("--skip-long", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = _config()
    lr = config["model"]["init_args"]["optimizer"]["init_args"]["lr"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); medians of {args.repeats} alternating "
          f"repeats (embedded); 'x' is shared / plain")
    module = _module(config)
    batches = real_batches(module, config, args.steps)
    b = batches[0]
    print(f"\nembedded: {b.num_rows} rows ({b.num_rows // GROUP} prompts x {GROUP}), prompt {b.prompt_length} "
          f"columns, responses <= {b.loss_mask.shape[1]} tokens (mean {float(b.response_lengths.float().mean()):.1f})")
    bench_update("embedded", module, batches, args.repeats, lr)
    prompts = [(x.input_ids[:, :x.prompt_length], x.attention_mask[:, :x.prompt_length]) for x in batches]
    bench_generate("embedded", module, prompts, config["data"]["init_args"]["sampling"]["max_new_tokens"], args.repeats)
    if args.skip_long:
        return
    with tempfile.TemporaryDirectory() as tmp:
        module = _module(config, model_name_or_path=str(long_checkpoint(Path(tmp) / "ckpt")))
    ids, mask = long_prompts(module, args.long_prompts)
    batch = long_batch(module, ids, mask)
    params = sum(p.numel() for p in module.policy.parameters()) / 1e6
    print(f"\nlong: {params:.1f}M-parameter Llama, {batch.num_rows} rows ({args.long_prompts} prompts x {GROUP}), "
          f"prompt {batch.prompt_length} columns, responses <= {batch.loss_mask.shape[1]} tokens "
          f"(mean {float(batch.response_lengths.float().mean()):.1f})")
    print(f"  (medians of {args.long_repeats} repeats)")
    bench_update("long", module, [batch], args.long_repeats, lr)
    bench_generate("long", module, [(ids, mask)], LONG_NEW, args.long_repeats)


if __name__ == "__main__":
    main()
