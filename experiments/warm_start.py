"""Build the embedded warm starts: a tiny Llama warm-started on arithmetic (default: ``embedded:arithmetic``).

RL needs a policy that is neither hopeless nor already solved, so this script trains the tiny Llama from
``rl_lightning.models.policy.build_tiny_policy`` with plain supervised steps on ``ArithmeticTask`` (by default
2-digit ``+``; ``--num-digits`` and ``--operations`` choose another task) and stops as soon as its greedy
exact-match accuracy on the task's 500 held-out problems reaches ``--target-accuracy`` (default 0.30, accepted
up to ``--max-accuracy`` = 0.50). It then saves the model (safetensors, fp32, ~4.3 MB), the character tokenizer
and ``warm_start.json`` (settings, task, steps, accuracy, wall time, library versions, the command) into
``--out`` (default ``rl_lightning/models/assets/arithmetic``; ``embedded:<name>`` loads
``rl_lightning/models/assets/<name>``).

The convention is the one the RL code uses:

* model input: ``<bos>`` + the prompt characters, e.g. ``<bos>37+48=`` (the tokenizer adds no BOS itself);
* target: the answer characters followed by ``<eos>``; the loss covers only those tokens (prompt = -100);
* correct: the greedy generation (at most 6 new tokens), cut at the first ``<eos>`` and stripped, equals
  the answer exactly.

Training prompts are ``ArithmeticTask(...).train_prompt(step * batch_size + row)``, a stream that never yields
a held-out problem. Everything runs on CPU and is deterministic for a given ``--seed``.

Evaluation runs every ``--coarse-eval-every`` steps (100) until the accuracy first reaches
``--fine-from`` (0.05), then every ``--eval-every`` steps (25), because accuracy climbs fast through the
20-50 % band. If an evaluation still overshoots ``--max-accuracy`` without any earlier one landing in range,
the script rewinds to the previous evaluation's weights and optimizer state and replays the same steps
(batches are a pure function of the step index, so the replay is exact), evaluating after every step; it
stops at the first step in range. Only if a single step jumps past ``--max-accuracy`` (or with
``--no-refine``) does it fail; then rerun with a smaller ``--eval-every`` or ``--lr``.

Reproduce (from the repository root; relative ``--out`` paths are taken from it)::

    .venv/bin/python experiments/warm_start.py   # embedded:arithmetic (2-digit addition, held-out accuracy 0.346)
    .venv/bin/python experiments/warm_start.py --num-digits 3 --target-accuracy 0.15 --max-accuracy 0.25 \
        --max-steps 6000 --out rl_lightning/models/assets/arithmetic_hard  # embedded:arithmetic_hard (3-digit, 0.200)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EXPERIMENTS = str(Path(__file__).resolve().parent)
if EXPERIMENTS not in sys.path:
    sys.path.insert(0, EXPERIMENTS)

import torch  # noqa: E402
import warm_start_common as common  # noqa: E402
from transformers import PreTrainedModel, PreTrainedTokenizerBase  # noqa: E402

from rl_lightning.envs import ArithmeticTask, Prompt  # noqa: E402

MAX_NEW_TOKENS = 6  # the configs' data.init_args.sampling.max_new_tokens: a 4-digit sum + <eos> fits
DEFAULT_OUT = Path("rl_lightning/models/assets/arithmetic")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--seed", type=int, default=0, help="seeds the model init (and all torch randomness)")
    p.add_argument("--num-digits", type=int, default=2, help="digits per operand of the ArithmeticTask")
    p.add_argument("--operations", nargs="+", default=["+"], choices=["+", "-", "*"],
                   help="operators of the ArithmeticTask (quote '*' in the shell)")
    common.add_options(p, "--lr")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=25, help="steps between evaluations once accuracy >= --fine-from")
    p.add_argument("--coarse-eval-every", type=int, default=100, help="steps between evaluations before that")
    p.add_argument("--fine-from", type=float, default=0.05, help="accuracy at which evaluation becomes fine-grained")
    common.add_window_options(p, "accuracy")
    common.add_options(p, "--max-steps", "--no-refine")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="output directory (relative paths are taken from the repository root); required "
                        "when the task is not the default one, so embedded:arithmetic is never overwritten")
    return p.parse_args(argv)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """``<bos>`` + prompt characters."""
    return [tokenizer.bos_token_id, *tokenizer(prompt.text, add_special_tokens=False)["input_ids"]]


def make_batch(
    task: ArithmeticTask, tokenizer: PreTrainedTokenizerBase, step: int, batch_size: int
) -> dict[str, torch.Tensor]:
    """Right-padded ``<bos> prompt answer <eos>`` rows; labels are -100 everywhere except answer + EOS.

    Right padding keeps position ids 0..n-1 on the real tokens, as in left-padded generation (where
    ``generate`` derives positions from the attention mask).
    """
    rows, label_rows = [], []
    for row in range(batch_size):
        prompt = task.train_prompt(step * batch_size + row)
        prefix = encode_prompt(tokenizer, prompt)
        target = [*tokenizer(prompt.answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        rows.append(prefix + target)
        label_rows.append([-100] * len(prefix) + target)
    return common.padded_batch(rows, label_rows, tokenizer.pad_token_id)


@torch.no_grad()
def heldout_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt], batch_size: int = 500
) -> float:
    """Greedy exact match: decoded generation before the first ``<eos>``, stripped, equals the answer."""
    was_training = model.training
    model.eval()
    correct = 0
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        encoded = [encode_prompt(tokenizer, p) for p in chunk]
        width = max(len(e) for e in encoded)
        input_ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
        attention_mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=pad,
            eos_token_id=eos,
        )
        for prompt, generated in zip(chunk, out[:, width:].tolist()):
            if eos in generated:
                generated = generated[: generated.index(eos)]
            text = tokenizer.decode(generated, skip_special_tokens=False).strip()
            correct += int(text == prompt.answer)
    model.train(was_training)
    return correct / len(prompts)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = common.output_dir(args.out)
    window = common.check_window(args, "accuracy")
    if (args.num_digits, args.operations) != (2, ["+"]) and args.out == DEFAULT_OUT:
        raise SystemExit(
            f"--num-digits {args.num_digits} --operations {' '.join(args.operations)} is not the task of "
            f"{DEFAULT_OUT} (2-digit +): give --out, e.g. --out rl_lightning/models/assets/arithmetic_hard"
        )

    t0 = time.perf_counter()
    model, tokenizer, optimizer = common.tiny_policy(args.seed, args.lr)
    task = ArithmeticTask(num_digits=args.num_digits, operations=args.operations)
    heldout = task.heldout_prompts()
    longest = max(len(tokenizer(p.answer, add_special_tokens=False)["input_ids"]) for p in heldout)
    if longest + 1 > MAX_NEW_TOKENS:
        raise SystemExit(f"answers of up to {longest} tokens + <eos> do not fit in {MAX_NEW_TOKENS} new tokens")

    def evaluate(loss: float | None) -> common.Evaluation:
        accuracy = heldout_accuracy(model, tokenizer, heldout)
        return common.Evaluation(accuracy, {"accuracy": accuracy}, f"held-out accuracy {accuracy:.3f}",
                                 {"acc": f"{accuracy:.3f}"})

    fine = False

    def interval(accuracy: float) -> int:  # coarse until the accuracy first reaches --fine-from
        nonlocal fine
        fine = fine or accuracy >= args.fine_from
        return args.eval_every if fine else args.coarse_eval_every

    run = common.train(model, optimizer,
                       lambda step: common.supervised_step(model, optimizer,
                                                           make_batch(task, tokenizer, step, args.batch_size)),
                       evaluate, desc="warm start", max_steps=args.max_steps, interval=interval, window=window,
                       refine=args.refine, postfix_every=10)
    step, accuracy = run.step, run.last.score
    if run.overshot:
        raise SystemExit(
            f"warm start overshot: held-out accuracy jumped to {accuracy:.3f} > {args.max_accuracy} at "
            f"step {step} without an evaluation landing in [{args.target_accuracy}, {args.max_accuracy}] "
            f"(history: {run.history[-3:]}). Rerun with a smaller --eval-every (e.g. 10) or a smaller --lr."
        )
    if not run.reached:
        raise SystemExit(
            f"warm start did not reach --target-accuracy {args.target_accuracy} within --max-steps "
            f"{args.max_steps} (last held-out accuracy {accuracy:.3f}); raise --max-steps or --lr."
        )
    train_seconds = time.perf_counter() - t0

    model.eval()
    common.save(model, tokenizer, out)
    reloaded_accuracy = heldout_accuracy(*common.reload(out), heldout)
    if reloaded_accuracy != accuracy:
        raise SystemExit(f"reloaded checkpoint scores {reloaded_accuracy:.3f}, expected {accuracy:.3f}")

    record = {
        **common.settings_record(args),
        "steps": step,
        "examples_seen": step * args.batch_size,
        "heldout_accuracy": accuracy,
        "heldout_size": len(heldout),
        "target_accuracy": args.target_accuracy,
        "max_accuracy": args.max_accuracy,
        "refined": run.refined,
        "eval_history": run.history,
        **common.timing_record(t0, train_seconds, model),
        "task": {"class": "ArithmeticTask", "num_digits": task.num_digits, "operations": task.operations,
                 "seed": task.seed},
        "max_new_tokens": MAX_NEW_TOKENS,
        **common.provenance_record(__file__, argv),
    }
    return common.finish(out, record, f"{step} steps, held-out accuracy {accuracy:.3f} (reloaded: "
                                      f"{reloaded_accuracy:.3f})")


if __name__ == "__main__":
    main()
