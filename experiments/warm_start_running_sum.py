"""Build ``embedded:running_sum``: a tiny Llama trained to convergence on a noisy teacher's running sums.

The task (``rl_lightning.envs.RunningSumTask``, defaults): 4-12 terms of 1-9, ``"3+7+2+9="`` ->
``"3+7=10;10+2=12;12+9=21;#21"`` + EOS (6 tokens a step with the number tokenizer, 21-69 tokens a response).

The supervised data come from a *noisy teacher* (``teacher_response``), seeded per training row, that writes the
steps of ``task.train_prompt(i)`` with three kinds of error:

* a *dropped ten*: on a step adding 8 or 9 that carries (the total's last digit + the term >= 10) it writes
  ``t + d - 10`` with probability ``--p-drop`` (0.5): the most likely total of such a step is wrong, so the
  converged policy's *greedy* answer is wrong on every problem with such a step (a systematic error RL can fix:
  the right total keeps probability ~0.35);
* a *slip*: on any step, with probability ``--p-slip`` (0.15), the total is off by a uniform non-zero offset in
  ``[-slip_width, slip_width]`` (``--slip-width`` 60; never below 0): mass spread over ~120 number tokens, the
  sampler's tail beyond its top 8;
* a *loop*: before each step after the first, with probability ``--p-loop`` (0.05), it repeats the previous step
  over and over (the training row shows ``--loop-repeats`` = 3 repeats and no EOS, at most the cap
  ``MAX_NEW_TOKENS`` = 72 tokens), so sampled responses that enter a loop run to the cap (truncated, reward 0).

After a slip or a dropped ten the teacher goes on from the total it wrote, and ``#`` copies its last total. The
model (hidden 128, 4 layers, 4 heads, ffn 512, 128 positions, the 1,008-token number vocabulary) is trained on
these rows (loss on the response and EOS) with AdamW, batch 32, at ``--lr`` (1e-3) until ``--decay-from`` (step 1000),
then a cosine decay to ``--min-lr`` (5e-5) at ``--decay-to`` (2200), and evaluated every ``--eval-every`` (150)
steps on the greedy test accuracy (the 500 problems of ``heldout_prompts``, ``RunningSumReward``, as
``val/reward``). It stops once converged: ``--plateau-evals`` consecutive evaluations (spanning
``(plateau_evals - 1) * eval_every`` steps) lie within ``--plateau-tol`` of each other, from ``--min-steps`` on;
the accepted accuracy must lie in ``[--target-accuracy, --max-accuracy]`` (0.2-0.4), else the script fails (no
saving mid-transition). It then saves the model, the tokenizer and ``warm_start.json`` (settings, the accuracy
curve, the plateau, greedy test and validation accuracy, sampled reward / truncation rate / tail mass at
temperature 1 on the first training batches, time, versions, the command) into ``--out``.

Reproduce (about 14 min on one CPU thread)::

    OMP_NUM_THREADS=1 .venv/bin/python experiments/warm_start_running_sum.py
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

EXPERIMENTS = str(Path(__file__).resolve().parent)
if EXPERIMENTS not in sys.path:
    sys.path.insert(0, EXPERIMENTS)

import torch  # noqa: E402
import warm_start_common as common  # noqa: E402
from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase  # noqa: E402

from rl_lightning.envs.running_sum import RunningSumTask  # noqa: E402
from rl_lightning.models.policy import tiny_llama_config  # noqa: E402
from rl_lightning.models.tokenizer import build_number_tokenizer  # noqa: E402
from rl_lightning.rollout import Evaluation, Recording, RolloutDataModule, Sampling  # noqa: E402

MAX_NEW_TOKENS = 72  # configs/tasks/running_sum.yaml's max_new_tokens: the longest response (69 tokens) fits
MAX_POSITIONS = 128  # <bos> + 24 prompt tokens + 72 response tokens = 97
DEFAULT_OUT = Path("rl_lightning/models/assets/running_sum")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--seed", type=int, default=0, help="seeds the model init, the teacher and all torch randomness")
    common.add_options(p, "--lr")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--p-drop", type=float, default=0.75, help="teacher: dropped ten on a carrying step adding 8/9")
    p.add_argument("--p-slip", type=float, default=0.15, help="teacher: a total off by a random offset")
    p.add_argument("--slip-width", type=int, default=60, help="teacher: largest slip offset")
    p.add_argument("--p-loop", type=float, default=0.08, help="teacher: starts repeating a step (before each step)")
    p.add_argument("--loop-repeats", type=int, default=3,
                   help="a looped training row shows the repeated step this many times (no EOS: it never ends)")
    p.add_argument("--decay-from", type=int, default=800, help="constant --lr until this step, then cosine decay")
    p.add_argument("--decay-to", type=int, default=1700, help="... to --min-lr at this step, then --min-lr")
    p.add_argument("--min-lr", type=float, default=5e-5)
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--min-steps", type=int, default=1700, help="the first step a plateau may end at")
    p.add_argument("--plateau-evals", type=int, default=4)
    p.add_argument("--plateau-tol", type=float, default=0.04, help="max - min of the plateau's accuracies")
    common.add_window_options(p, "accuracy", low_help="the plateau's accuracy must be at least this",
                              high_help="and at most this")
    p.set_defaults(target_accuracy=0.2, max_accuracy=0.4)
    p.add_argument("--max-steps", type=int, default=2700)
    p.add_argument("--sampled-steps", type=int, default=8,
                   help="training batches (16 prompts x 8 responses, temperature 1) the sampled facts come from")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=common.OUT_HELP)
    return p.parse_args(argv)


def teacher_response(terms: list[int], rng: random.Random, args: argparse.Namespace
                     ) -> tuple[str, bool, dict[str, int]]:
    """The noisy teacher's response to ``terms`` (see the module docstring): ``(text, looped, error counts)``.

    A looped response is the steps so far, then the last one ``--loop-repeats`` more times (the caller gives it no
    EOS and cuts it at ``MAX_NEW_TOKENS``): the model learns that a repeat is followed by another.
    """
    total, steps = terms[0], []
    errors = {"drop": 0, "slip": 0}
    for k, term in enumerate(terms[1:]):
        if k > 0 and rng.random() < args.p_loop:
            return "".join(steps) + steps[-1] * args.loop_repeats, True, errors
        right = total + term
        u = rng.random()
        if term >= 8 and total % 10 + term >= 10 and u < args.p_drop:
            written = right - 10
            errors["drop"] += 1
        elif u >= 1 - args.p_slip:
            offset = 0
            while offset == 0 or right + offset < 0:
                offset = rng.randint(-args.slip_width, args.slip_width)
            written = right + offset
            errors["slip"] += 1
        else:
            written = right
        steps.append(f"{total}+{term}={written};")
        total = written
    return "".join(steps) + f"#{total}", False, errors


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """``--lr`` until ``--decay-from``, a cosine to ``--min-lr`` at ``--decay-to``, then ``--min-lr``."""
    if step < args.decay_from:
        return args.lr
    if step >= args.decay_to:
        return args.min_lr
    progress = (step - args.decay_from) / (args.decay_to - args.decay_from)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def make_batch(task: RunningSumTask, tokenizer: PreTrainedTokenizerBase, step: int, args: argparse.Namespace
               ) -> dict[str, torch.Tensor]:
    """Right-padded ``<bos> prompt response <eos>`` rows (a looped response: cut at the cap, no EOS); labels are
    -100 on the prompt. Row ``i`` of step ``s`` is training prompt ``s * batch_size + i``, its teacher seeded by
    ``(seed, s * batch_size + i)``: a pure function of the step."""
    rows, label_rows = [], []
    for row in range(args.batch_size):
        index = step * args.batch_size + row
        prompt = task.train_prompt(index)
        text, looped, _ = teacher_response(prompt.metadata["terms"], common.episode_rng(args.seed, index), args)
        prefix = [tokenizer.bos_token_id, *tokenizer(prompt.text, add_special_tokens=False)["input_ids"]]
        target = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        target = target[:MAX_NEW_TOKENS] if looped else [*target, tokenizer.eos_token_id]
        rows.append(prefix + target)
        label_rows.append([-100] * len(prefix) + target)
    return common.padded_batch(rows, label_rows, tokenizer.pad_token_id)


def datamodule(task: RunningSumTask, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
               eval_split: str = "test", record_topk: int = 0) -> RolloutDataModule:
    """The preset's data module (16 prompts x 8 responses, the cap) bound to ``model`` through a stand-in trainer."""
    dm = RolloutDataModule(task=task, prompts_per_step=16, group_size=8, seed=0,
                           sampling=Sampling(max_new_tokens=MAX_NEW_TOKENS),
                           evaluation=Evaluation(batch_size=500, split=eval_split),
                           record=Recording(topk=record_topk))
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(policy=model, tokenizer=tokenizer),
                                 global_rank=0, world_size=1)
    return dm


@torch.no_grad()
def greedy_accuracy(task: RunningSumTask, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    split: str = "test") -> float:
    was_training = model.training
    model.eval()
    total, count = datamodule(task, model, tokenizer, split).evaluate()
    model.train(was_training)
    return total / count


@torch.no_grad()
def sampled_facts(task: RunningSumTask, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, steps: int
                  ) -> dict:
    """Temperature-1 rollouts of the first ``steps`` training batches: reward, truncation rate (responses cut at
    the cap), response length, and the tail mass ``1 - sum(top-8 probs)`` of the sampler at every sampled token
    (its mean, and its mean over the tokens that follow ``=``: the written totals)."""
    model.eval()
    dm = datamodule(task, model, tokenizer, record_topk=8)
    eq = tokenizer.convert_tokens_to_ids("=")
    rewards, truncated, lengths, tails, total_tails, all_zero = [], [], [], [], [], 0
    for batch in common.training_rollouts(dm, steps):
        rewards.append(batch.rewards)
        truncated.append(batch.truncated.float())
        lengths.append(batch.loss_mask.sum(dim=1).float())
        mask = batch.loss_mask.bool()
        tail = 1 - batch.record.topk_logprobs.exp().sum(dim=-1)  # [N, T]
        tails.append(tail[mask])
        response = batch.input_ids[:, batch.prompt_length:]
        after_eq = torch.zeros_like(mask)
        after_eq[:, 1:] = response[:, :-1] == eq
        total_tails.append(tail[mask & after_eq])
        all_zero += int((batch.rewards.view(-1, batch.group_size).max(dim=1).values == 0).sum())
    r, t = torch.cat(rewards), torch.cat(truncated)
    tail_all, tail_tot = torch.cat(tails), torch.cat(total_tails)
    return {"episodes": r.numel(), "reward": round(float(r.mean()), 4), "truncation_rate": round(float(t.mean()), 4),
            "response_length": round(float(torch.cat(lengths).mean()), 2),
            "all_zero_group_fraction": round(all_zero / (r.numel() // 8), 4),
            "tail_mass_top8": round(float(tail_all.mean()), 4), "sampled_tokens": tail_all.numel(),
            "tail_mass_top8_at_totals": round(float(tail_tot.mean()), 4), "total_tokens": tail_tot.numel()}


def teacher_facts(task: RunningSumTask, args: argparse.Namespace, n: int = 20000) -> dict:
    """What the teacher itself scores on the first ``n`` training rows (its own accuracy and loop rate)."""
    from rl_lightning.envs.running_sum import RunningSumReward

    reward = RunningSumReward()
    correct, loops, drops, slips = 0, 0, 0, 0
    for index in range(n):
        prompt = task.train_prompt(index)
        text, looped, errors = teacher_response(prompt.metadata["terms"], common.episode_rng(args.seed, index), args)
        loops += looped
        drops += errors["drop"]
        slips += errors["slip"]
        correct += 0 if looped else int(reward(prompt, text))
    return {"rows": n, "accuracy": correct / n, "loop_rate": loops / n, "drops_per_row": drops / n,
            "slips_per_row": slips / n}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = common.output_dir(args.out)
    window = common.check_window(args, "accuracy")
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    tokenizer = build_number_tokenizer()
    config = tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=MAX_POSITIONS,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    task = RunningSumTask()
    if task.max_response_tokens() > MAX_NEW_TOKENS:
        raise SystemExit(f"responses of {task.max_response_tokens()} tokens do not fit in {MAX_NEW_TOKENS}")
    accuracies: list[float] = []

    def evaluate(loss: float | None) -> common.Evaluation:
        accuracy = greedy_accuracy(task, model, tokenizer)
        accuracies.append(accuracy)
        return common.Evaluation(accuracy, {"accuracy": accuracy, **({"loss": round(loss, 4)} if loss else {})},
                                 f"greedy test accuracy {accuracy:.3f}", {"acc": f"{accuracy:.3f}"})

    def converged(last: common.Evaluation) -> bool:
        recent = accuracies[-args.plateau_evals:]
        return len(recent) == args.plateau_evals and max(recent) - min(recent) <= args.plateau_tol

    def train_step(step: int) -> float:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        return common.supervised_step(model, optimizer, make_batch(task, tokenizer, step, args))

    run = common.train(model, optimizer, train_step,
                       evaluate, desc="warm start running_sum", max_steps=args.max_steps,
                       interval=lambda _: args.eval_every, min_steps=args.min_steps, accept=converged,
                       postfix_every=10)
    train_seconds = time.perf_counter() - t0
    accuracy = run.last.score
    plateau = accuracies[-args.plateau_evals:]
    if not run.reached:
        raise SystemExit(f"no plateau within --max-steps {args.max_steps} (last accuracies {accuracies[-6:]})")
    mean_plateau = sum(plateau) / len(plateau)
    if not window[0] <= mean_plateau <= window[1]:
        raise SystemExit(f"converged at greedy test accuracy {mean_plateau:.3f} (plateau {plateau}), outside "
                         f"[{window[0]}, {window[1]}]: change the teacher's --p-drop / --p-slip")
    model.eval()
    common.save(model, tokenizer, out)
    reloaded, reloaded_tok = common.reload(out)
    reloaded_accuracy = greedy_accuracy(task, reloaded, reloaded_tok)
    if abs(reloaded_accuracy - accuracy) > 1e-9:
        raise SystemExit(f"reloaded checkpoint scores {reloaded_accuracy:.4f}, expected {accuracy:.4f}")
    validation_accuracy = greedy_accuracy(task, reloaded, reloaded_tok, "validation")
    sampled = sampled_facts(task, reloaded, reloaded_tok, args.sampled_steps)
    record = {
        **common.settings_record(args),
        "lr_schedule": {"constant_until": args.decay_from, "cosine_to": args.decay_to, "min_lr": args.min_lr},
        "teacher": {"p_drop": args.p_drop, "p_slip": args.p_slip, "slip_width": args.slip_width,
                    "p_loop": args.p_loop, **teacher_facts(task, args)},
        "steps": run.step,
        "examples_seen": run.step * args.batch_size,
        "heldout_accuracy": accuracy,
        "heldout_size": len(task.heldout_prompts()),
        "validation_accuracy": validation_accuracy,
        "validation_size": len(task.validation_prompts()),
        "plateau": {"evaluations": args.plateau_evals, "every": args.eval_every, "tolerance": args.plateau_tol,
                    "accuracies": plateau, "mean": round(mean_plateau, 4)},
        "target_accuracy": args.target_accuracy,
        "max_accuracy": args.max_accuracy,
        "eval_history": run.history,
        "sampled_temperature_1": {"batches": args.sampled_steps, "prompts_per_batch": 16, "group_size": 8,
                                  **sampled},
        **common.timing_record(t0, train_seconds, model),
        "threads": torch.get_num_threads(),
        "task": {"class": "RunningSumTask", "min_terms": task.min_terms, "max_terms": task.max_terms,
                 "max_term": task.max_term, "seed": task.seed},
        "model": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 512,
                  "max_position_embeddings": MAX_POSITIONS, "vocab_size": len(tokenizer)},
        "max_new_tokens": MAX_NEW_TOKENS,
        **common.provenance_record(__file__, argv),
    }
    return common.finish(out, record, f"{run.step} steps, greedy test accuracy {accuracy:.3f} (validation "
                                      f"{validation_accuracy:.3f}), sampled truncation {sampled['truncation_rate']}, "
                                      f"tail mass {sampled['tail_mass_top8']}")


if __name__ == "__main__":
    main()
