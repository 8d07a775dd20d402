"""Build ``embedded:guess``: the tiny Llama warm-started on guess-the-number (``GuessNumberTask``, multi-turn).

RL needs a policy that is neither hopeless nor already solved. This script trains the tiny Llama of
``rl_lightning.models.policy.build_tiny_policy`` (character tokenizer, 64 positions) with plain supervised steps
on episodes of a deliberately imperfect expert and stops as soon as its *greedy* success on the task's held-out
set (every secret of ``1..31`` once) reaches ``--target-success`` (default 0.30, accepted up to
``--max-success`` = 0.50). It saves the model, the tokenizer and ``warm_start.json`` (settings, steps, greedy and
sampled success, wall time, versions, the command) into ``--out`` (default
``rl_lightning/models/assets/guess``, loaded as ``embedded:guess``).

The expert (``--expert pivot``, the default): noisy bisection. At each turn it takes the interval still
consistent with the feedback, ``n`` numbers, and guesses its ``floor(--pivot * (n - 1))``-th (0.5: the midpoint)
plus an offset of -2..2 drawn with probabilities 0.1, 0.2, 0.4, 0.2, 0.1, clipped into the interval. It finds the
secret within 5 guesses in 79.5 % of episodes (``expert_success``; exact bisection finds every secret). The model
imitates every expert episode, found or not, and training stops early, while the model is still learning where
the midpoint is, as the arithmetic warm start stops before it has learnt to add; RL then has to sharpen it.
Also tried (short GRPO / REINFORCE probes, lr 1e-4, 60 steps): ``--expert uniform`` (a uniform guess inside the
consistent interval, 54.3 %; its warm start, stopped at greedy 0.323, did not improve), and ``--pivot 0.1
--min-steps 400`` (a search from the low end, learnt to convergence: greedy 0.419, but 56 % of the GRPO groups
have constant rewards, so little signal; it improved no faster).

Token layout, exactly what ``GroupRollout(max_turns=5)`` of ``RolloutDataModule`` feeds the model (no chat
template, ``add_bos``): ``<bos>`` + the first observation's characters (``"guess 1-31:"``); then per turn the
guess's characters and ``<eos>``, followed (unless the episode ended) by the observation's characters
(``tok(obs, add_special_tokens=False)``: ``"hi:"`` / ``"lo:"``). E.g. ``<bos>guess 1-31:16<eos>hi:24<eos>lo:20<eos>``.
The loss covers only the guesses and their ``<eos>`` (the prompt and observations are -100). After training the
script checks the layout against real rollouts: for sampled rollouts of the data module it rebuilds each
episode's ids from its decoded guesses (observations replayed through a fresh ``GuessNumberEnv``) with the same
function that builds the training rows, and requires them to equal ``RolloutBatch.input_ids``.

Evaluation goes through the library: greedy held-out success is the mean reward of ``RolloutDataModule.rollout``
on its held-out batches (the validation path), and the saved checkpoint is re-scored by
``Trainer.validate(GRPO(model_name_or_path=<out>), datamodule=...)`` (its ``val/reward`` must be the same
number). Sampled success (temperature 1, the training path) is measured on the first ``--sampled-steps`` training
batches (16 prompts x 8 episodes) and recorded, with the fraction of groups whose 8 rewards are all equal
(no GRPO signal).

Evaluation runs every ``--eval-every`` steps; if one overshoots ``--max-success`` with no earlier one in range,
the script rewinds to the previous evaluation's weights and optimizer state and replays the same steps (batches
are a pure function of the step index), evaluating after every step, and stops at the first step in range.
Everything runs on CPU and is deterministic for a given ``--seed``.

Reproduce (from the repository root)::

    .venv/bin/python experiments/warm_start_guess.py
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from functools import lru_cache
from pathlib import Path

EXPERIMENTS = str(Path(__file__).resolve().parent)
if EXPERIMENTS not in sys.path:
    sys.path.insert(0, EXPERIMENTS)

import torch  # noqa: E402
import warm_start_common as common  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402

from rl_lightning.envs.guess import GuessNumberTask  # noqa: E402
from rl_lightning.rollout import RolloutDataModule  # noqa: E402

# configs/tasks/guess.yaml: max_new_tokens two digits + <eos>; GroupRollout(max_turns = GuessNumberTask.max_guesses,
# max_episode_tokens: 5 turns of 3 + 4 observations of 4 ("bad:") fit)
PRESET = common.EpisodePreset(GuessNumberTask, val_batch_size=64, max_new_tokens=3, max_turns=5, max_episode_tokens=32)
DEFAULT_OUT = Path("rl_lightning/models/assets/guess")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--seed", type=int, default=0, help="seeds the model init, the expert and all torch randomness")
    common.add_options(p, "--lr")
    p.add_argument("--batch-size", type=int, default=64, help="expert episodes per step")
    p.add_argument("--expert", choices=["pivot", "uniform"], default="pivot",
                   help="pivot: guesses near --pivot of the consistent interval (+-2); uniform: anywhere in it")
    p.add_argument("--pivot", type=float, default=0.5, help="the pivot expert's pivot, a fraction of the interval")
    p.add_argument("--min-steps", type=int, default=0,
                   help="train at least this many steps before the first evaluation that may stop training")
    p.add_argument("--eval-every", type=int, default=10, help="steps between greedy held-out evaluations")
    common.add_window_options(p, "success")
    common.add_options(p, "--max-steps", "--sampled-steps")
    p.add_argument("--log-sampled", action="store_true",
                   help="also measure sampled success (2 training batches) at every evaluation")
    common.add_options(p, "--no-refine")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=common.OUT_HELP)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- the expert
NOISE = {-2: 0.1, -1: 0.2, 0: 0.4, 1: 0.2, 2: 0.1}  # the pivot expert's offset from its pivot


def expert_offsets(n: int, expert: str, pivot: float) -> dict[int, float]:
    """The expert's distribution over guesses, as offsets ``0..n-1`` from the low end of the ``n`` numbers still
    consistent with the feedback.

    ``uniform``: every consistent number alike. ``pivot``: ``floor(pivot * (n - 1))`` plus an offset of -2..2
    (probabilities 0.1, 0.2, 0.4, 0.2, 0.1), clipped into the interval: with ``pivot`` 0.1 it searches from the
    low end of the interval, never bisects.
    """
    if expert == "uniform":
        return {i: 1 / n for i in range(n)}
    if expert == "pivot":
        centre = int(pivot * (n - 1))
        out: dict[int, float] = {}
        for d, p in NOISE.items():
            i = min(n - 1, max(0, centre + d))
            out[i] = out.get(i, 0.0) + p
        return out
    raise ValueError(f"unknown expert {expert!r}")


def expert_episode(task: GuessNumberTask, secret: int, rng: random.Random, expert: str, pivot: float
                   ) -> tuple[str, list[str], list[str]]:
    """One episode of the expert, played through ``GuessNumberEnv``: ``(first observation, guesses, observations)``.

    ``observations[k]`` is what the environment answered to guess ``k`` (``""`` after the last one).
    """
    env = task.make_env(task.heldout_prompts()[secret - task.low], task.default_reward())
    first, _ = env.reset()
    low, high = task.low, task.high
    guesses, observations = [], []
    while True:
        offsets = expert_offsets(high - low + 1, expert, pivot)
        guess = low + rng.choices(list(offsets), weights=list(offsets.values()))[0]
        obs, _, terminated, truncated, _ = env.step(str(guess))
        guesses.append(str(guess))
        observations.append(obs)
        if terminated or truncated:
            return first, guesses, observations
        if obs == "hi:":
            low = guess + 1
        elif obs == "lo:":
            high = guess - 1


def expert_success(task: GuessNumberTask, expert: str, pivot: float) -> float:
    """Exact probability that the expert finds a uniformly drawn secret within ``max_guesses``."""

    @lru_cache(maxsize=None)
    def found(n: int, k: int) -> float:  # n candidates left, k guesses left, secret uniform among them
        if n <= 0 or k == 0:
            return 0.0
        return sum(p * (1 / n + i / n * found(i, k - 1) + (n - 1 - i) / n * found(n - 1 - i, k - 1))
                   for i, p in expert_offsets(n, expert, pivot).items())

    return found(task.high - task.low + 1, task.max_guesses)


def expert_greedy_success(task: GuessNumberTask, expert: str, pivot: float) -> float | None:
    """Held-out success of the expert's most likely guess at every turn (``None`` when that is not unique)."""
    found = 0
    for secret in range(task.low, task.high + 1):
        low, high = task.low, task.high
        for _ in range(task.max_guesses):
            offsets = expert_offsets(high - low + 1, expert, pivot)
            best = max(offsets.values())
            if sum(p == best for p in offsets.values()) > 1:
                return None
            guess = low + max(offsets, key=offsets.get)
            if guess == secret:
                found += 1
                break
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)
    return found / (task.high - task.low + 1)


# ---------------------------------------------------------------------------------------------- training rows
def make_batch(task: GuessNumberTask, tokenizer: PreTrainedTokenizerBase, step: int, batch_size: int, seed: int,
               expert: str, pivot: float) -> dict[str, torch.Tensor]:
    """Right-padded expert episodes in the rollout's layout (``common.episode_ids``)."""
    def episode(index: int) -> tuple[str, list[str], list[str]]:
        secret = int(task.train_prompt(index).metadata["secret"])
        return expert_episode(task, secret, common.episode_rng(seed, index), expert, pivot)

    return common.episode_batch(tokenizer, (episode(step * batch_size + row) for row in range(batch_size)))


def check_layout(dm: RolloutDataModule, tokenizer: PreTrainedTokenizerBase) -> dict:
    """``common.check_layout`` on sampled rollouts; episodes holding a sampled special token in a turn (not in
    the expert's layout) are counted, not compared."""
    compared, cut, special = common.check_layout(dm, tokenizer, skip_special_tokens=True)
    if not compared:
        raise SystemExit("layout check compared no episode (every one had a turn cut without <eos>)")
    return {"episodes_compared": len(compared), "episodes_with_a_cut_turn": cut,
            "episodes_with_a_special_token_in_a_turn": special}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = common.output_dir(args.out)
    window = common.check_window(args, "success")

    t0 = time.perf_counter()
    model, tokenizer, optimizer = common.tiny_policy(args.seed, args.lr, max_position_embeddings=common.MAX_POSITIONS)
    task = GuessNumberTask()
    if task.max_guesses != PRESET.max_turns:
        raise SystemExit(f"GuessNumberTask().max_guesses={task.max_guesses} != {PRESET.max_turns} turns")
    dm = PRESET.datamodule(model, tokenizer, seed=args.seed)

    def evaluate(loss: float | None) -> common.Evaluation:
        success = common.greedy_success(dm)
        if loss is None:
            return common.Evaluation(success, {"greedy_success": success}, "", {})
        entry = {"loss": round(loss, 4), "greedy_success": round(success, 4)}
        text = f"greedy held-out success {success:.3f}"
        if args.log_sampled:
            model.eval()
            entry["sampled_success"] = common.sampled_success(dm, 2)["success"]
            model.train()
            text += f"  sampled {entry['sampled_success']:.3f}"
        return common.Evaluation(success, entry, text, {"success": f"{success:.3f}"})

    run = common.train(model, optimizer,
                       lambda step: common.supervised_step(model, optimizer, make_batch(
                           task, tokenizer, step, args.batch_size, args.seed, args.expert, args.pivot)),
                       evaluate, desc="warm start (guess)", max_steps=args.max_steps,
                       interval=lambda _: args.eval_every, window=window, min_steps=args.min_steps,
                       refine=args.refine)
    step, success = run.step, run.last.score
    if run.overshot:
        raise SystemExit(f"warm start overshot: greedy success {success:.3f} > {args.max_success} at step "
                         f"{step} (history: {run.history[-3:]}); rerun with a smaller --eval-every or --lr")
    if not run.reached:
        raise SystemExit(f"warm start did not reach --target-success {args.target_success} within --max-steps "
                         f"{args.max_steps} (last greedy success {success:.3f}); raise --max-steps or --lr")
    train_seconds = time.perf_counter() - t0

    model.eval()
    sampled = common.sampled_success(dm, args.sampled_steps)
    layout = check_layout(dm, tokenizer)
    common.save(model, tokenizer, out)
    reloaded_success, library_success = PRESET.check_saved(out, success)

    record = {
        **common.settings_record(args),
        "expert": args.expert,
        "pivot": args.pivot if args.expert == "pivot" else None,
        "expert_success": round(expert_success(task, args.expert, args.pivot), 4),
        "expert_greedy_success": expert_greedy_success(task, args.expert, args.pivot),
        "min_steps": args.min_steps,
        "steps": step,
        "episodes_seen": step * args.batch_size,
        "heldout_greedy_success": success,
        "heldout_size": len(task.heldout_prompts()),
        "sampled_success": sampled,
        "target_success": args.target_success,
        "max_success": args.max_success,
        "refined": run.refined,
        "eval_history": run.history,
        "layout_check": layout,
        **common.timing_record(t0, train_seconds, model),
        "task": {"class": "GuessNumberTask", "low": task.low, "high": task.high, "max_guesses": task.max_guesses,
                 "seed": task.seed},
        "rollout": PRESET.record(),
        **common.provenance_record(__file__, argv),
    }
    return common.finish(out, record, f"{step} steps, greedy held-out success {success:.3f} (reloaded "
                                      f"{reloaded_success:.3f}, Trainer.validate {library_success:.3f}), sampled "
                                      f"success {sampled}, layout check {layout}")


if __name__ == "__main__":
    main()
