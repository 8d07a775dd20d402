"""LoRA in the rollout: the decode step multiplying by merged effective weights against running the adapters.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_lora_decode.py [--model DIR] [--rows 32] [--tokens 32]
        [--repeats 3]

In a rollout of at least ``static_decode.MERGE_MIN_STEPS`` decode steps, ``StaticDecoder`` multiplies each
LoRA-adapted projection by its effective weight, the base weight with the active adapters merged
(``models.adapters.effective_weight``, computed once per rollout), instead of running the adapted layer's forward
(the base product, then ``A`` and ``B``: three products and an add per projection and token). This script forces
each way whatever the rollout's length (the threshold patched to 0 and to never) and samples the same rollouts from
the local checkpoint ``--model`` (default SmolLM2-135M-Instruct; nothing is downloaded) with LoRA adapters (rank 16,
α 32, the seven projections, ``B`` drawn nonzero as after training) both ways, and from the model without adapters,
in alternation (``sample``, temperature 1, the same generator seed per repeat), and prints each way's median rollout
time and how far the merged rollouts' tokens and log-probs are from those through the adapters (a different
rounding: a token can flip where two candidates' probabilities tie to a few ulps, after which the rows diverge).
Shorter rollouts (``--tokens`` below the threshold) show what the threshold avoids: the merge's fixed cost.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as common



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_option(p)
    p.add_argument("--rows", type=int, default=32, help="rows per rollout (8 per prompt)")
    p.add_argument("--tokens", type=int, default=32, help="most new tokens per row")
    p.add_argument("--repeats", type=int, default=3, help="alternating rollouts per way")
    args = p.parse_args()
    ckpt = common.checkpoint_dir(args.model)

    import copy

    import torch

    from rl_lightning.models.adapters import LoraSettings, add_lora
    from rl_lightning.models.policy import load_policy
    from rl_lightning.rollout import SamplingParams, static_decode

    plain, tok = load_policy(str(ckpt))
    plain.eval()
    adapted = add_lora(copy.deepcopy(plain), LoraSettings(rank=16, alpha=32.0)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in adapted.named_parameters():
            if ".lora_B." in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.01)
    ids, mask = common.chat_prompt_batch(tok, args.rows)
    params = SamplingParams(max_tokens=args.tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ways = {"merged (effective weights)": (adapted, lambda: mock.patch.object(static_decode, "MERGE_MIN_STEPS", 0)),
            "through the adapters": (adapted, lambda: mock.patch.object(static_decode, "MERGE_MIN_STEPS", 10**9)),
            "no adapters": (plain, contextlib.nullcontext)}
    same_tokens, logp_diff = [], []
    print(common.machine_line())
    print(f"model: {ckpt}; {ids.shape[0]} rows, prompts of {ids.shape[1]} tokens, at most {args.tokens} new tokens; "
          f"LoRA rank 16 on the seven projections; {args.repeats} alternating rollouts per way")

    def after_round(repeat: int, out: dict, times: dict) -> None:
        a, b = out["merged (effective weights)"], out["through the adapters"]
        equal_rows = (a.response_ids == b.response_ids).all(-1)
        same_tokens.append(float(equal_rows.float().mean()))
        both = a.mask.bool() & b.mask.bool() & equal_rows.unsqueeze(-1)
        logp_diff.append(float((a.logprobs - b.logprobs).abs()[both].max()) if both.any() else float("nan"))
        print(f"  rollout {repeat}: " + ", ".join(f"{name} {times[name][-1]:.2f} s" for name in ways)
              + f"; {int(a.mask.sum())} tokens")

    times = common.alternate_rollouts(ways, ids, mask, params, args.repeats, after_round)
    base = statistics.median(times["through the adapters"])
    common.print_table(
        ["rollout", "median s", "vs through the adapters"],
        ([name, f"{statistics.median(ts):.2f}", f"{statistics.median(ts) / base:.2f}"] for name, ts in times.items()))
    print(f"merged against through the adapters: identical rows {min(same_tokens):.3f}-{max(same_tokens):.3f} of "
          f"each rollout; largest log-prob difference on identical rows {max(logp_diff):.1e}")


if __name__ == "__main__":
    main()
