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

Reproduce (from anywhere)::

    python experiments/warm_start_guess.py
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import sys
import time
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "experiments"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402
from warm_start import padded_batch  # noqa: E402

from rl_lightning.envs.guess import GuessNumberEnv, GuessNumberTask  # noqa: E402
from rl_lightning.models.policy import build_tiny_policy  # noqa: E402
from rl_lightning.rollout import GroupRollout, RolloutDataModule  # noqa: E402

MAX_NEW_TOKENS = 3  # data.init_args.max_new_tokens of configs/tasks/guess.yaml: two digits + <eos>
MAX_TURNS = 5  # GroupRollout(max_turns=...) of configs/tasks/guess.yaml (= GuessNumberTask.max_guesses)
MAX_EPISODE_TOKENS = 32  # GroupRollout(max_episode_tokens=...): 5 turns of 3 + 4 observations of 4 ("bad:") fit
MAX_POSITIONS = 64  # the tiny Llama's max_position_embeddings
DEFAULT_OUT = Path("rl_lightning/models/assets/guess")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the model init, the expert and all torch randomness")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument("--batch-size", type=int, default=64, help="expert episodes per step")
    p.add_argument("--expert", choices=["pivot", "uniform"], default="pivot",
                   help="pivot: guesses near --pivot of the consistent interval (+-2); uniform: anywhere in it")
    p.add_argument("--pivot", type=float, default=0.5, help="the pivot expert's pivot, a fraction of the interval")
    p.add_argument("--min-steps", type=int, default=0,
                   help="train at least this many steps before the first evaluation that may stop training")
    p.add_argument("--eval-every", type=int, default=10, help="steps between greedy held-out evaluations")
    p.add_argument("--target-success", type=float, default=0.30, help="stop at the first eval at or above this")
    p.add_argument("--max-success", type=float, default=0.50, help="fail if the first eval >= target exceeds this")
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--sampled-steps", type=int, default=8,
                   help="training batches (16 prompts x 8 episodes, temperature 1) the sampled success is measured on")
    p.add_argument("--log-sampled", action="store_true",
                   help="also measure sampled success (2 training batches) at every evaluation")
    p.add_argument("--no-refine", dest="refine", action="store_false",
                   help="on overshoot, fail at once instead of replaying the last interval step by step")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="output directory (relative paths are taken from the repository root)")
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


# ---------------------------------------------------------------------------------------------- token layout
def episode_ids(tokenizer: PreTrainedTokenizerBase, first: str, actions: list[str], observations: list[str]
                ) -> tuple[list[int], list[int]]:
    """The ids the rollout feeds the model for this episode, and labels (-100 except on the model's tokens).

    ``<bos>`` + ``first``; per turn ``action`` + ``<eos>`` (labelled), then ``observation`` (not labelled; an
    empty one, after the episode's last turn, adds nothing).
    """
    def chars(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    ids = [tokenizer.bos_token_id, *chars(first)]
    labels = [-100] * len(ids)
    for action, obs in zip(actions, observations):
        turn = [*chars(action), tokenizer.eos_token_id]
        ids += turn
        labels += turn
        seen = chars(obs)
        ids += seen
        labels += [-100] * len(seen)
    return ids, labels


def make_batch(task: GuessNumberTask, tokenizer: PreTrainedTokenizerBase, step: int, batch_size: int, seed: int,
               expert: str, pivot: float) -> dict[str, torch.Tensor]:
    """Right-padded expert episodes (positions 0..n-1 on the real tokens, as in left-padded generation)."""
    rows, label_rows = [], []
    for row in range(batch_size):
        index = step * batch_size + row
        secret = int(task.train_prompt(index).metadata["secret"])
        rng = random.Random((seed * 1_000_003 + index) * 31 + 17)
        ids, labels = episode_ids(tokenizer, *expert_episode(task, secret, rng, expert, pivot))
        if len(ids) > MAX_POSITIONS:
            raise SystemExit(f"an episode of {len(ids)} tokens does not fit in {MAX_POSITIONS} positions")
        rows.append(ids)
        label_rows.append(labels)
    return padded_batch(rows, label_rows, tokenizer.pad_token_id)


# ---------------------------------------------------------------------------------------------- evaluation
def make_datamodule(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> RolloutDataModule:
    """The data module of ``configs/tasks/guess.yaml`` (with the method configs' 16 prompts x 8), attached to
    ``model`` through a stand-in trainer so its rollouts can be called directly."""
    return episode_datamodule(GuessNumberTask(), model, tokenizer, seed, val_batch_size=64,
                              max_new_tokens=MAX_NEW_TOKENS, max_turns=MAX_TURNS, max_episode_tokens=MAX_EPISODE_TOKENS)


def episode_datamodule(task: object, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, seed: int, *,
                       val_batch_size: int, max_new_tokens: int, max_turns: int,
                       max_episode_tokens: int) -> RolloutDataModule:
    """A 16 prompts x 8 episode data module for ``task``, attached to ``model`` through a stand-in trainer."""
    dm = RolloutDataModule(
        task=task, prompts_per_step=16, group_size=8, max_new_tokens=max_new_tokens,
        val_batch_size=val_batch_size, seed=seed,
        strategy=GroupRollout(max_turns=max_turns, max_episode_tokens=max_episode_tokens),
    )
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(policy=model, tokenizer=tokenizer),
                                 global_rank=0, world_size=1)
    return dm


@torch.no_grad()
def greedy_success(dm: RolloutDataModule) -> float:
    """Mean held-out reward of the data module's greedy rollouts (what ``val/reward`` logs)."""
    total, count = dm.evaluate()
    return total / count


@torch.no_grad()
def sampled_success(dm: RolloutDataModule, steps: int) -> dict:
    """Temperature-1 rollouts of the first ``steps`` training batches: mean reward, and the fraction of groups
    whose rewards are all equal (all found or none: zero advantage under GRPO)."""
    dm.cursor = 0
    rewards, flat_groups = [], 0
    for step in range(steps):
        batch = dm.rollout(dm.prompt_batch(step))
        r = batch.rewards.view(-1, batch.group_size)
        rewards.append(r)
        flat_groups += int((r.max(dim=1).values == r.min(dim=1).values).sum())
    dm.cursor = 0
    r = torch.cat(rewards)
    return {"success": round(float(r.mean()), 4), "episodes": r.numel(), "groups": r.shape[0],
            "constant_group_fraction": round(flat_groups / r.shape[0], 4),
            "all_zero_group_fraction": round(float((r.max(dim=1).values == 0).float().mean()), 4)}


@torch.no_grad()
def check_layout(dm: RolloutDataModule, tokenizer: PreTrainedTokenizerBase, steps: int = 2) -> dict:
    """Rebuild sampled rollouts' ids with ``episode_ids`` and compare with ``RolloutBatch.input_ids``.

    Guesses come from the model tokens (``turn_index``) of each row; observations from replaying the guesses in
    a fresh environment. Episodes with a turn cut without ``<eos>`` or holding a sampled special token (neither is
    in the expert's layout) are counted, not compared.
    """
    eos = tokenizer.eos_token_id
    task: GuessNumberTask = dm.task  # type: ignore[assignment]
    compared, skipped, special = 0, 0, 0
    dm.cursor = 0
    for step in range(steps):
        batch = dm.rollout(dm.prompt_batch(step))
        P = batch.prompt_length
        for row in range(batch.num_rows):
            real = batch.attention_mask[row].bool()
            ids = batch.input_ids[row][real].tolist()
            turn_index = batch.turn_index[row].tolist()
            response = batch.input_ids[row, P:].tolist()
            turns = [[tok for tok, t in zip(response, turn_index) if t == k] for k in range(int(batch.num_turns[row]))]
            if any(not t or t[-1] != eos for t in turns):
                skipped += 1
                continue
            actions = [tokenizer.decode(t[:-1], skip_special_tokens=True) for t in turns]
            if any(tokenizer(a, add_special_tokens=False)["input_ids"] != t[:-1] for a, t in zip(actions, turns)):
                special += 1  # a sampled special token (e.g. <pad>) inside a turn: its text is not its ids
                continue
            env = GuessNumberEnv(int(batch.prompts[row].metadata["secret"]), task.low, task.high, task.max_guesses)
            first, _ = env.reset()
            observations, ret = [], 0.0
            for action in actions:
                obs, reward, terminated, truncated, _ = env.step(action)
                observations.append(obs)
                ret += reward
            rebuilt, _ = episode_ids(tokenizer, first, actions, observations)
            if rebuilt != ids:
                raise SystemExit(
                    f"token layout differs from the rollout's (step {step}, row {row}):\n  rollout {ids}\n"
                    f"  rebuilt {rebuilt}\n  rollout text {tokenizer.decode(ids)!r}")
            if ret != float(batch.rewards[row]):
                raise SystemExit(f"replayed return {ret} != rollout reward {float(batch.rewards[row])} (row {row})")
            compared += 1
    dm.cursor = 0
    if compared == 0:
        raise SystemExit("layout check compared no episode (every one had a turn cut without <eos>)")
    return {"episodes_compared": compared, "episodes_with_a_cut_turn": skipped,
            "episodes_with_a_special_token_in_a_turn": special}


def validate_with_library(out: Path, dm: RolloutDataModule | None = None) -> float:
    """``val/reward`` of ``Trainer.validate`` on ``GRPO(model_name_or_path=out)`` with the preset's data module
    (``dm``; default: the guess preset's)."""
    import lightning.pytorch as pl

    from rl_lightning.algorithms import GRPO

    module = GRPO(model_name_or_path=str(out))
    if dm is None:
        dm = RolloutDataModule(task=GuessNumberTask(), max_new_tokens=MAX_NEW_TOKENS, val_batch_size=64,
                               strategy=GroupRollout(max_turns=MAX_TURNS, max_episode_tokens=MAX_EPISODE_TOKENS))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, datamodule=dm, verbose=False)
    return float(trainer.callback_metrics["val/reward"])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = args.out if args.out.is_absolute() else REPO_ROOT / args.out
    if not 0 < args.target_success <= args.max_success:
        raise SystemExit(f"need 0 < --target-success ({args.target_success}) <= --max-success ({args.max_success})")

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    model, tokenizer = build_tiny_policy(seed=args.seed, max_position_embeddings=MAX_POSITIONS)
    model.train()
    task = GuessNumberTask()
    if task.max_guesses != MAX_TURNS:
        raise SystemExit(f"GuessNumberTask().max_guesses={task.max_guesses} != {MAX_TURNS} turns")
    dm = make_datamodule(model, tokenizer, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(step: int) -> float:
        batch = make_batch(task, tokenizer, step, args.batch_size, args.seed, args.expert, args.pivot)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

    history: list[dict] = []
    success = greedy_success(dm)
    history.append({"step": 0, "greedy_success": success})
    next_eval = args.eval_every
    snapshot = (0, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
    step, loss, reached, refining = 0, float("nan"), False, False
    bar = tqdm(total=args.max_steps, desc="warm start (guess)", unit="step", dynamic_ncols=True)
    while step < args.max_steps:
        loss = train_step(step)
        step += 1
        bar.update(1)
        if step < next_eval:
            continue
        success = greedy_success(dm)
        entry = {"step": step, "loss": round(loss, 4), "greedy_success": round(success, 4)}
        if args.log_sampled:
            model.eval()
            entry["sampled_success"] = sampled_success(dm, 2)["success"]
            model.train()
        history.append({**entry, **({"refine": True} if refining else {})})
        bar.write(f"step {step:5d}  loss {loss:.4f}  greedy held-out success {success:.3f}"
                  + (f"  sampled {entry['sampled_success']:.3f}" if args.log_sampled else "")
                  + ("  (refine)" if refining else ""))
        bar.set_postfix(loss=f"{loss:.3f}", success=f"{success:.3f}")
        if step >= args.min_steps and success >= args.target_success:
            if success <= args.max_success:
                reached = True
                break
            if args.refine and not refining and step - snapshot[0] > 1:
                start, model_state, optim_state = snapshot
                bar.write(f"overshot ({success:.3f} > {args.max_success}); replaying steps {start + 1}..{step} "
                          "with an evaluation after each")
                model.load_state_dict(model_state)
                optimizer.load_state_dict(optim_state)
                bar.update(start - step)
                step, refining, next_eval = start, True, start + 1
                continue
            bar.close()
            raise SystemExit(f"warm start overshot: greedy success {success:.3f} > {args.max_success} at step "
                             f"{step} (history: {history[-3:]}); rerun with a smaller --eval-every or --lr")
        next_eval = step + (1 if refining else args.eval_every)
        if args.refine and not refining:
            snapshot = (step, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
    bar.close()
    if not reached:
        raise SystemExit(f"warm start did not reach --target-success {args.target_success} within --max-steps "
                         f"{args.max_steps} (last greedy success {success:.3f}); raise --max-steps or --lr")
    train_seconds = time.perf_counter() - t0

    model.eval()
    sampled = sampled_success(dm, args.sampled_steps)
    layout = check_layout(dm, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)

    # Reload exactly as the package will, and check the saved checkpoint scores the same, twice over.
    reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    reloaded_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    reloaded_success = greedy_success(make_datamodule(reloaded, reloaded_tok))
    library_success = validate_with_library(out)
    if max(abs(reloaded_success - success), abs(library_success - success)) > 1e-6:  # val/reward is float32
        raise SystemExit(f"reloaded checkpoint scores {reloaded_success:.4f} (Trainer.validate: {library_success:.4f}),"
                         f" expected {success:.4f}")

    record = {
        "seed": args.seed,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "optimizer": "AdamW",
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
        "refined": refining,
        "eval_history": history,
        "layout_check": layout,
        "wall_time_s": round(time.perf_counter() - t0, 2),
        "train_time_s": round(train_seconds, 2),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "task": {"class": "GuessNumberTask", "low": task.low, "high": task.high, "max_guesses": task.max_guesses,
                 "seed": task.seed},
        "rollout": {"strategy": "GroupRollout", "max_turns": MAX_TURNS, "max_episode_tokens": MAX_EPISODE_TOKENS,
                    "max_new_tokens": MAX_NEW_TOKENS},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "command": "python experiments/warm_start_guess.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    (out / "warm_start.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved to {out}: {step} steps, greedy held-out success {success:.3f} (reloaded {reloaded_success:.3f}, "
          f"Trainer.validate {library_success:.3f}), sampled success {sampled}, layout check {layout}, "
          f"{record['wall_time_s']:.1f}s")
    return record


if __name__ == "__main__":
    main()
