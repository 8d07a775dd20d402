"""Build ``embedded:reach``: the tiny Llama trained to convergence on a noisy teacher of reach-the-target
(``ReachTargetTask``, multi-turn, 8-10 model turns).

RL needs a policy that is neither hopeless nor already solved, and the critic studies need one that is *converged*
(its supervised curve flat), not one caught half-way through learning. This script trains the tiny Llama of
``rl_lightning.models.policy.build_tiny_policy`` (character tokenizer, 128 positions: an episode takes up to 66) with
plain supervised steps on episodes of a noisy teacher for a fixed ``--max-steps`` (learning rate constant, then
cosine-decayed to a tenth over the last ``--decay-fraction`` of the steps), evaluating greedy success on the test
split (and on the validation split) every ``--eval-every`` steps, and saves the *last* checkpoint. It checks that
the last ``--plateau-evals`` evaluations are flat (their range within ``--plateau-tolerance``) and that the final
greedy test success is in [``--target-success``, ``--max-success``] (default [0.20, 0.40]). It saves the model,
the tokenizer and ``warm_start.json`` (settings, the success curve, the plateau, greedy test and validation success,
sampled success and episode length at temperature 1, wall time, versions, the command) into ``--out`` (default
``rl_lightning/models/assets/reach``, loaded as ``embedded:reach``).

The teacher (why not a noisy *optimal* planner: a converged imitator's greedy move is the teacher's most likely
one, which uniform noise never changes, so its greedy success would be the optimal planner's minus whatever the
model fails to learn: not a number one can aim at). The teacher mixes two planners move by move: with probability
``--optimal-share`` (0.2) it plays the shortest-solution move of all four moves, otherwise the shortest-solution
move of ``+1 +5 -3`` (a planner that never doubles), and with probability ``--noise`` (0.1) either is replaced by a
uniformly drawn legal move. Where the two planners differ the never-doubling one is the most likely move (0.745
against 0.205), so a converged imitator's greedy policy is the never-doubling planner's: it reaches the target
within 10 moves on 36 % of the test pairs and 40 % of the validation pairs (those within about 50 of the start;
``teacher.test.greedy_success`` in ``warm_start.json``), and its greedy success plateaus there. Sampled at
temperature 1 it still doubles at the right value now and then (the teacher's own episodes reach 20 % of the
targets the never-doubling planner misses), which is what RL can reinforce: when doubling pays.
Tried first: the never-doubling planner with uniform noise 0.25 (``--optimal-share 0``): the same greedy plateau
(0.357 after 1500 steps), but GRPO (8 prompts x 8, 100 steps) only sharpened the sampled policy (train reward
0.11 -> 0.30, entropy 0.24 -> 0.06) and left the greedy test success flat (0.357 -> 0.355): a doubling drawn with
probability 0.06 is too rare to reinforce.

Token layout, exactly what ``GroupRollout(max_turns=10)`` of ``RolloutDataModule`` feeds the model (no chat
template, ``add_bos``), built by ``episode_ids`` of ``experiments/warm_start_common.py``: ``<bos>`` + the first
observation's characters (``"s17 t52:"``); then per turn the move's characters and ``<eos>``, followed (unless the
episode ended) by the observation's characters (``"22:"``). The loss covers only the moves and their ``<eos>``.
After training the script checks the layout against real sampled rollouts (``common.check_layout``).

Evaluation goes through the library: greedy success is the mean reward of ``RolloutDataModule.rollout`` on its
held-out batches (the validation path), and the saved checkpoint is re-scored by
``Trainer.validate(GRPO(model_name_or_path=<out>), datamodule=...)`` (its ``val/reward`` must be the same number).
Everything runs on CPU and is deterministic for a given ``--seed``.

With the defaults (seed 0): greedy test success 0.13, 0.27, 0.18, 0.31, 0.31, 0.31 at steps 400-1,400 (flat at the
constant learning rate from step 1,000), then 0.333, 0.340, 0.347 as it decays (the teacher's greedy: 0.36); the last
checkpoint scores 0.347 on the test split and 0.390 on the validation split, 0.202 sampled at temperature 1, with
9.5 turns per episode. Then GRPO (``configs/grpo.yaml`` + ``configs/tasks/reach.yaml``, one seed) moved the greedy
test success to 0.648 at step 100, 0.540 at step 150 and 0.632 at step 300.

Reproduce (from the repository root; 2,000 steps of about 0.45 s alone on one CPU thread, about 15 min; the shipped
build took 31 min with the machine's 2 cores shared with other jobs)::

    OMP_NUM_THREADS=1 .venv/bin/python experiments/warm_start_reach.py
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

EXPERIMENTS = str(Path(__file__).resolve().parent)
if EXPERIMENTS not in sys.path:
    sys.path.insert(0, EXPERIMENTS)

import torch  # noqa: E402
import warm_start_common as common  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402

from rl_lightning.envs.reach import MOVES, ReachTargetTask, apply_move, best_move  # noqa: E402
from rl_lightning.rollout import RolloutDataModule  # noqa: E402

MAX_POSITIONS = 128  # this warm start's tiny Llama: an episode takes up to 9 + 10 x 3 + 9 x 3 = 66 positions
# configs/tasks/reach.yaml: max_new_tokens a move + <eos>; GroupRollout(max_turns = ReachTargetTask.max_moves,
# max_episode_tokens: 10 turns of <= 3 tokens and 9 observations of <= 3 ("99:") fit in 60)
PRESET = common.EpisodePreset(ReachTargetTask, val_batch_size=200, max_new_tokens=3, max_turns=10,
                              max_episode_tokens=60)
DEFAULT_OUT = Path("rl_lightning/models/assets/reach")
#: the moves the teacher plans with (it never doubles on purpose)
TEACHER_MOVES = ("+1", "+5", "-3")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--seed", type=int, default=0, help="seeds the model init, the teacher and all torch randomness")
    common.add_options(p, "--lr")
    p.add_argument("--batch-size", type=int, default=64, help="teacher episodes per step")
    p.add_argument("--optimal-share", type=float, default=0.2,
                   help="probability that the teacher plays the optimal planner's move (else the never-doubling one)")
    p.add_argument("--noise", type=float, default=0.1,
                   help="probability that a teacher move is replaced by a uniformly drawn legal move")
    p.add_argument("--max-steps", type=int, default=2000, help="supervised steps (the last checkpoint is saved)")
    p.add_argument("--decay-fraction", type=float, default=0.3,
                   help="the learning rate decays (cosine, to a tenth) over this last fraction of the steps")
    p.add_argument("--eval-every", type=int, default=200, help="steps between greedy evaluations")
    p.add_argument("--plateau-evals", type=int, default=4, help="the last evaluations that must be flat")
    p.add_argument("--plateau-tolerance", type=float, default=0.06,
                   help="largest range of greedy test success over the last --plateau-evals evaluations")
    p.add_argument("--target-success", type=float, default=0.20, help="lowest final greedy test success accepted")
    p.add_argument("--max-success", type=float, default=0.40, help="highest final greedy test success accepted")
    common.add_options(p, "--sampled-steps")
    p.add_argument("--no-checks", dest="checks", action="store_false",
                   help="save even when the plateau or the success window check fails (for exploring settings)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=common.OUT_HELP)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- the teacher
def teacher_move(value: int, target: int, rng: random.Random, noise: float, optimal_share: float) -> str:
    """The teacher's move: with probability ``noise`` a uniformly drawn legal move of all four; otherwise, with
    probability ``optimal_share``, a shortest-solution move of all four moves, else one of ``+1 +5 -3`` (ties: the
    first in ``MOVES``)."""
    if rng.random() < noise:
        return rng.choice([m for m in MOVES if apply_move(value, m) is not None])
    if rng.random() < optimal_share:
        return best_move(value, target)
    return best_move(value, target, TEACHER_MOVES)


def teacher_episode(task: ReachTargetTask, start: int, target: int, rng: random.Random, noise: float,
                    optimal_share: float) -> tuple[str, list[str], list[str], float]:
    """One teacher episode, played through ``ReachTargetEnv``: ``(first observation, moves, observations, return)``
    (``observations[k]`` answers move ``k``; ``""`` after the last)."""
    env = task.make_env(task.make_prompt(start, target), task.default_reward())
    first, _ = env.reset()
    moves, observations, ret = [], [], 0.0
    while True:
        move = teacher_move(env.value, target, rng, noise, optimal_share)
        obs, reward, terminated, truncated, _ = env.step(move)
        moves.append(move)
        observations.append(obs)
        ret += reward
        if terminated or truncated:
            return first, moves, observations, ret


def teacher_success(task: ReachTargetTask, pairs: list[tuple[int, int]], noise: float, optimal_share: float,
                    episodes: int = 4, seed: int = 0) -> dict:
    """Mean return and turns of the teacher on ``pairs``: ``episodes`` each as it plays (noisy), and once with its
    most likely move at every state (greedy: the never-doubling planner while ``optimal_share < 0.5``)."""
    rng = random.Random(seed)
    noisy = [teacher_episode(task, s, t, rng, noise, optimal_share) for s, t in pairs for _ in range(episodes)]
    greedy = [teacher_episode(task, s, t, rng, 0.0, 0.0 if optimal_share < 0.5 else 1.0) for s, t in pairs]
    return {"greedy_success": round(statistics.mean(e[3] for e in greedy), 4),
            "greedy_turns": round(statistics.mean(len(e[1]) for e in greedy), 3),
            "noisy_success": round(statistics.mean(e[3] for e in noisy), 4),
            "noisy_turns": round(statistics.mean(len(e[1]) for e in noisy), 3)}


# ---------------------------------------------------------------------------------------------- training rows
def make_batch(task: ReachTargetTask, tokenizer: PreTrainedTokenizerBase, step: int, batch_size: int, seed: int,
               noise: float, optimal_share: float) -> dict[str, torch.Tensor]:
    """Right-padded teacher episodes in the rollout's layout (``common.episode_ids``), 128 positions."""
    rows, label_rows = [], []
    for index in range(step * batch_size, (step + 1) * batch_size):
        meta = task.train_prompt(index).metadata
        first, moves, observations, _ = teacher_episode(task, meta["start"], meta["target"],
                                                        common.episode_rng(seed, index), noise, optimal_share)
        ids, labels = common.episode_ids(tokenizer, first, moves, observations)
        if len(ids) > MAX_POSITIONS:
            raise SystemExit(f"an episode of {len(ids)} tokens does not fit in {MAX_POSITIONS} positions")
        rows.append(ids)
        label_rows.append(labels)
    return common.padded_batch(rows, label_rows, tokenizer.pad_token_id)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Constant ``--lr``, then a cosine decay to a tenth of it over the last ``--decay-fraction`` of the steps."""
    decay_start = int(args.max_steps * (1 - args.decay_fraction))
    if step < decay_start:
        return args.lr
    frac = (step - decay_start) / max(1, args.max_steps - decay_start)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def greedy_stats(dm: RolloutDataModule, split: str) -> dict:
    """Greedy success and mean turns on ``split`` (``"test"`` or ``"validation"``) through the data module."""
    held = dm.evaluation
    dm.evaluation = replace(held, split=split)
    try:
        rewards, turns = [], []
        for batch in dm.val_prompt_batches():
            out = dm.rollout(batch)
            rewards += out.rewards.tolist()
            turns += out.turns.count.tolist()
    finally:
        dm.evaluation = held
    return {"success": round(statistics.mean(rewards), 4), "turns": round(statistics.mean(turns), 3),
            "episodes": len(rewards)}


@torch.no_grad()
def sampled_stats(dm: RolloutDataModule, steps: int) -> dict:
    """``common.sampled_success`` with the mean turns and the share of episodes of >= 8 turns of the same rollouts."""
    stats = common.sampled_success(dm, steps)
    turns = torch.cat([b.turns.count.float() for b in common.training_rollouts(dm, steps)])
    return {**stats, "mean_turns": round(float(turns.mean()), 3),
            "share_8_or_more_turns": round(float((turns >= 8).float().mean()), 4)}


def check_layout(dm: RolloutDataModule, tokenizer: PreTrainedTokenizerBase) -> dict:
    """``common.check_layout`` on sampled rollouts; episodes holding a sampled special token in a turn are counted."""
    compared, cut, special = common.check_layout(dm, tokenizer, skip_special_tokens=True)
    if not compared:
        raise SystemExit("layout check compared no episode (every one had a turn cut without <eos>)")
    return {"episodes_compared": len(compared), "episodes_with_a_cut_turn": cut,
            "episodes_with_a_special_token_in_a_turn": special}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = common.output_dir(args.out)
    if not 0 < args.target_success <= args.max_success:
        raise SystemExit(f"need 0 < --target-success ({args.target_success}) <= --max-success ({args.max_success})")
    if not (0 <= args.optimal_share < 0.5 and 0 <= args.noise < 1):
        raise SystemExit(f"need 0 <= --optimal-share ({args.optimal_share}) < 0.5 and 0 <= --noise ({args.noise}) < 1")
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    model, tokenizer, optimizer = common.tiny_policy(args.seed, args.lr, max_position_embeddings=MAX_POSITIONS)
    task = ReachTargetTask()
    if task.max_moves != PRESET.max_turns:
        raise SystemExit(f"ReachTargetTask().max_moves={task.max_moves} != {PRESET.max_turns} turns")
    dm = PRESET.datamodule(model, tokenizer, seed=args.seed)

    def evaluate(loss: float | None) -> common.Evaluation:
        model.eval()
        try:
            test, val = greedy_stats(dm, "test"), greedy_stats(dm, "validation")
        finally:
            model.train()
        entry = {"test_success": test["success"], "validation_success": val["success"], "test_turns": test["turns"]}
        if loss is not None:
            entry = {"loss": round(loss, 4), "lr": round(lr_at(step_seen[0], args), 6), **entry}
        text = f"greedy test {test['success']:.3f} validation {val['success']:.3f} turns {test['turns']:.2f}"
        return common.Evaluation(test["success"], entry, text, {"test": f"{test['success']:.3f}"})

    step_seen = [0]

    def train_step(step: int) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        step_seen[0] = step
        return common.supervised_step(model, optimizer, make_batch(task, tokenizer, step, args.batch_size, args.seed,
                                                                   args.noise, args.optimal_share))

    run = common.train(model, optimizer, train_step, evaluate, desc="warm start (reach)", max_steps=args.max_steps,
                       interval=lambda _: args.eval_every, accept=lambda _: False)
    train_seconds = time.perf_counter() - t0
    success = run.last.score
    tail = [h["test_success"] for h in run.history[-args.plateau_evals:]]
    plateau = {"evals": args.plateau_evals, "steps": [h["step"] for h in run.history[-args.plateau_evals:]],
               "test_success": tail, "range": round(max(tail) - min(tail), 4),
               "tolerance": args.plateau_tolerance,
               "binomial_se": round(math.sqrt(success * (1 - success) / len(task.heldout_prompts())), 4)}
    problems = []
    if plateau["range"] > args.plateau_tolerance:
        problems.append(f"not converged: greedy test success over the last {args.plateau_evals} evaluations {tail} "
                         f"ranges over {plateau['range']} > {args.plateau_tolerance}; raise --max-steps")
    if not args.target_success <= success <= args.max_success:
        problems.append(f"converged greedy test success {success:.3f} outside [{args.target_success}, "
                        f"{args.max_success}]")
    if problems and args.checks:
        raise SystemExit("; ".join(problems))
    for problem in problems:
        print(f"check failed (saved anyway, --no-checks): {problem}")

    model.eval()
    test, validation = greedy_stats(dm, "test"), greedy_stats(dm, "validation")
    sampled = sampled_stats(dm, args.sampled_steps)
    layout = check_layout(dm, tokenizer)
    common.save(model, tokenizer, out)
    reloaded_success, library_success = PRESET.check_saved(out, success)

    record = {
        **common.settings_record(args),
        "schedule": {"lr": args.lr, "decay_fraction": args.decay_fraction, "final_lr": round(lr_at(args.max_steps - 1,
                                                                                                   args), 6)},
        "teacher": {"plans_with": list(TEACHER_MOVES), "optimal_share": args.optimal_share, "noise": args.noise,
                    "noise_moves": list(MOVES),
                    "test": teacher_success(task, task.test, args.noise, args.optimal_share),
                    "validation": teacher_success(task, task.validation, args.noise, args.optimal_share),
                    "train_pool": teacher_success(task, task.train, args.noise, args.optimal_share)},
        "steps": args.max_steps,
        "episodes_seen": args.max_steps * args.batch_size,
        "test_greedy_success": test["success"],
        "test_greedy_mean_turns": test["turns"],
        "test_size": test["episodes"],
        "validation_greedy_success": validation["success"],
        "validation_greedy_mean_turns": validation["turns"],
        "validation_size": validation["episodes"],
        "sampled_success": sampled,
        "plateau": plateau,
        "checks_failed": problems,
        "eval_history": run.history,
        "layout_check": layout,
        **common.timing_record(t0, train_seconds, model),
        "max_position_embeddings": MAX_POSITIONS,
        "task": {"class": "ReachTargetTask", "num_heldout": len(task.test), "num_validation": len(task.validation),
                 "train_pairs": len(task.train), "max_moves": task.max_moves, "gap": [task.min_gap, task.max_gap],
                 "optimal_moves": [task.min_optimal, task.max_optimal], "seed": task.seed},
        "rollout": PRESET.record(),
        **common.provenance_record(__file__, argv),
    }
    return common.finish(out, record, f"{args.max_steps} steps, greedy test success {success:.3f} (reloaded "
                                      f"{reloaded_success:.3f}, Trainer.validate {library_success:.3f}), validation "
                                      f"{validation['success']:.3f}, sampled {sampled}, plateau {plateau}")


if __name__ == "__main__":
    main()
