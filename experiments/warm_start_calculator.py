"""Build ``embedded:calculator``: the tiny Llama warm-started on the calculator tool-use task (``CalculatorTask``).

RL needs a policy that is neither hopeless nor already solved, and for a tool-use task one that does not call
the tool every time already: this script trains the tiny Llama of ``rl_lightning.models.policy.build_tiny_policy``
(character tokenizer, 64 positions) with plain supervised steps on a mix of two kinds of episodes and stops at
the first evaluation where its *greedy* success on the task's 100 held-out problems is in [``--target-success``,
``--max-success``] (default [0.30, 0.50]) while it calls the tool on a share of them in [``--min-tool-rate``,
``--max-tool-rate``] (default [0.10, 0.50]). It saves the model, the tokenizer and ``warm_start.json`` (settings,
steps, greedy success and tool-call rate, sampled success, wall time, versions, the command) into ``--out``
(default ``rl_lightning/models/assets/calculator``, loaded as ``embedded:calculator``).

The episodes (the true answer in both; the prompt stream is ``CalculatorTask().train_prompt(index)``, which never
yields a held-out problem):

* with probability ``--tool-fraction`` (default 0.3) *tool use*: call the calculator on the problem, then copy
  its result, ``c37*8`` -> ``=296:`` -> ``296`` (played through ``CalculatorEnv``, so the observation is the
  environment's own);
* otherwise *a direct answer*, ``296``: multiplying in its head is what the tiny model mostly fails to learn.

Copying the calculator's result is learned fast; which of the two the greedy policy does first is decided
per problem by whether ``c`` or its best guess of the answer's first digit is likelier, so the warm start calls
the tool on some held-out problems (nearly always right) and answers the others directly (mostly wrong). RL can
raise the first share.

Token layout, exactly what ``GroupRollout(max_turns=3)`` of ``RolloutDataModule`` feeds the model (no chat
template, ``add_bos``), built by ``episode_ids`` of ``experiments/warm_start_guess.py``: ``<bos>`` + the first
observation's characters (``"37*8="``); then per turn the action's characters and ``<eos>``, followed (unless the
episode ended) by the observation's characters: ``<bos>37*8=c37*8<eos>=296:296<eos>`` or ``<bos>37*8=296<eos>``.
The loss covers only the model's turns and their ``<eos>`` (the prompt and observations are -100). After training
the script checks the layout against real rollouts: for sampled rollouts of the data module it rebuilds each
episode's ids from its decoded turns (observations replayed through a fresh ``CalculatorEnv``) with the same
function that builds the training rows, and requires them to equal ``RolloutBatch.input_ids``.

Evaluation goes through the library: greedy held-out success is the mean reward of ``RolloutDataModule.rollout``
on its held-out batches (the validation path), and the saved checkpoint is re-scored by
``Trainer.validate(GRPO(model_name_or_path=<out>), datamodule=...)`` (its ``val/reward`` must be the same
number). Each evaluation also records the fraction of held-out episodes whose first turn calls the tool.
Sampled success (temperature 1, the training path) is measured on the first ``--sampled-steps`` training batches
(16 prompts x 8 episodes) and recorded with the sampled tool-call rate and the fraction of groups whose 8 rewards
are all equal (no GRPO signal).

Evaluation runs every ``--eval-every`` steps. Neither number climbs steadily, so there is no rewinding as in the
other warm starts: the policy first learns to call the tool on every problem (success rising to ~0.5 as it learns
to copy), then to answer more and more of them directly (the tool-call rate swings between ~0.05 and ~0.6 from
one evaluation to the next, direct answers are right ~10-30 % of the time). The first evaluation inside all three
windows (success, tool-call rate, and ``--min-tool-success`` = 0.90 of the tool-calling episodes right: copying is
learned, only the choice to call is left to RL) is kept. With the defaults that is step 160: greedy held-out
success 0.32 (24 tool calls, 22 right; 76 direct answers, 10 right), sampled success 0.20 (tool-call rate 0.22).
Everything runs on CPU and is deterministic for a given ``--seed``.

Reproduce (from anywhere)::

    python experiments/warm_start_calculator.py
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

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
from warm_start_guess import episode_datamodule, episode_ids, greedy_success, sampled_success  # noqa: E402
from warm_start_guess import validate_with_library as validate_episodes  # noqa: E402

from rl_lightning.envs.calculator import CalculatorTask  # noqa: E402
from rl_lightning.models.policy import build_tiny_policy  # noqa: E402
from rl_lightning.rollout import GroupRollout, RolloutBatch, RolloutDataModule  # noqa: E402

MAX_NEW_TOKENS = 6  # data.init_args.max_new_tokens of configs/tasks/calculator.yaml: "c99*9" + <eos>
MAX_TURNS = 3  # GroupRollout(max_turns=...) of configs/tasks/calculator.yaml (= CalculatorTask.max_calls + 1)
MAX_EPISODE_TOKENS = 32  # GroupRollout(max_episode_tokens=...): 3 turns of 6 + 2 observations of <= 7 ("=99999:")
MAX_POSITIONS = 64  # the tiny Llama's max_position_embeddings
DEFAULT_OUT = Path("rl_lightning/models/assets/calculator")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the model init, the episode mix and all torch randomness")
    p.add_argument("--tool-fraction", type=float, default=0.3, help="share of training episodes that use the tool")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument("--batch-size", type=int, default=64, help="episodes per step")
    p.add_argument("--eval-every", type=int, default=10, help="steps between greedy held-out evaluations")
    p.add_argument("--target-success", type=float, default=0.30, help="lowest greedy held-out success accepted")
    p.add_argument("--max-success", type=float, default=0.50, help="highest greedy held-out success accepted")
    p.add_argument("--min-tool-rate", type=float, default=0.10,
                   help="lowest greedy held-out tool-call rate accepted (RL needs tool calls to reinforce)")
    p.add_argument("--min-tool-success", type=float, default=0.90,
                   help="lowest greedy success of the held-out episodes that call the tool (copying is learned)")
    p.add_argument("--max-tool-rate", type=float, default=0.50,
                   help="highest greedy held-out tool-call rate accepted (the policy must still answer directly)")
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--sampled-steps", type=int, default=8,
                   help="training batches (16 prompts x 8 episodes, temperature 1) the sampled success is measured on")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="output directory (relative paths are taken from the repository root)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- the episodes
def demo_episode(task: CalculatorTask, index: int, use_tool: bool) -> tuple[str, list[str], list[str]]:
    """Training episode ``index`` played through ``CalculatorEnv``: ``(first observation, actions, observations)``.

    With ``use_tool``: ``["c37*8", "296"]`` and ``["=296:", ""]``; without: ``["296"]`` and ``[""]``.
    """
    prompt = task.train_prompt(index)
    env = task.make_env(prompt, task.default_reward())
    first, _ = env.reset()
    a, b = prompt.metadata["a"], prompt.metadata["b"]
    actions = ([f"c{a}*{b}"] if use_tool else []) + [prompt.answer]
    observations = []
    for k, action in enumerate(actions):
        obs, reward, terminated, truncated, _ = env.step(action)
        observations.append(obs)
        last = k == len(actions) - 1
        if terminated != last or (last and reward != 1.0):
            raise SystemExit(f"episode {index} ({prompt.text!r}, actions {actions}) did not play out as expected")
    return first, actions, observations


def uses_tool(index: int, seed: int, tool_fraction: float) -> bool:
    """Whether training episode ``index`` is a tool-use one (a pure function of seed and index)."""
    return random.Random((seed * 1_000_003 + index) * 31 + 17).random() < tool_fraction


def make_batch(task: CalculatorTask, tokenizer: PreTrainedTokenizerBase, step: int, batch_size: int, seed: int,
               tool_fraction: float) -> dict[str, torch.Tensor]:
    """Right-padded training episodes (positions 0..n-1 on the real tokens, as in left-padded generation)."""
    rows, label_rows = [], []
    for row in range(batch_size):
        index = step * batch_size + row
        ids, labels = episode_ids(tokenizer, *demo_episode(task, index, uses_tool(index, seed, tool_fraction)))
        if len(ids) > MAX_POSITIONS:
            raise SystemExit(f"an episode of {len(ids)} tokens does not fit in {MAX_POSITIONS} positions")
        rows.append(ids)
        label_rows.append(labels)
    return padded_batch(rows, label_rows, tokenizer.pad_token_id)


# ---------------------------------------------------------------------------------------------- evaluation
def make_datamodule(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> RolloutDataModule:
    """The data module of ``configs/tasks/calculator.yaml`` (with the method configs' 16 prompts x 8), attached to
    ``model`` through a stand-in trainer so its rollouts can be called directly."""
    return episode_datamodule(CalculatorTask(), model, tokenizer, seed, val_batch_size=100,
                              max_new_tokens=MAX_NEW_TOKENS, max_turns=MAX_TURNS, max_episode_tokens=MAX_EPISODE_TOKENS)


def turn_ids(batch: RolloutBatch, row: int) -> list[list[int]]:
    """The ids the model sampled in each turn of episode ``row`` (``<eos>`` included where the turn closed)."""
    response = batch.input_ids[row, batch.prompt_length:].tolist()
    turn_index = batch.turn_index[row].tolist()
    return [[tok for tok, t in zip(response, turn_index) if t == k] for k in range(int(batch.num_turns[row]))]


def called_tool(batch: RolloutBatch, tokenizer: PreTrainedTokenizerBase) -> list[bool]:
    """Per episode: whether its first turn is a tool call (starts with ``c``)."""
    return [tokenizer.decode(turn_ids(batch, row)[0], skip_special_tokens=True).strip().startswith("c")
            for row in range(batch.num_rows)]


@torch.no_grad()
def tool_use(dm: RolloutDataModule, batches: list) -> dict:
    """Rollouts of ``batches`` (greedy for held-out ones): tool-call rate, success, and success split by whether
    the episode called the tool."""
    tool, reward = [], []
    for prompt_batch in batches:
        batch = dm.rollout(prompt_batch)
        tool += called_tool(batch, dm.tokenizer)
        reward += batch.rewards.tolist()
    with_tool = [r for t, r in zip(tool, reward) if t]
    direct = [r for t, r in zip(tool, reward) if not t]
    return {"episodes": len(tool), "success": round(sum(reward) / len(reward), 4),
            "tool_call_rate": round(sum(tool) / len(tool), 4),
            "success_with_tool": round(sum(with_tool) / len(with_tool), 4) if with_tool else None,
            "success_direct": round(sum(direct) / len(direct), 4) if direct else None}


def heldout_tool_use(dm: RolloutDataModule) -> dict:
    return tool_use(dm, dm.val_prompt_batches())


def sampled_tool_use(dm: RolloutDataModule, steps: int) -> dict:
    dm.cursor = 0
    out = tool_use(dm, [dm.prompt_batch(step) for step in range(steps)])  # rolled out in order: the cursor follows
    dm.cursor = 0
    return out


@torch.no_grad()
def check_layout(dm: RolloutDataModule, tokenizer: PreTrainedTokenizerBase, steps: int = 2) -> dict:
    """Rebuild sampled rollouts' ids with ``episode_ids`` and compare with ``RolloutBatch.input_ids``.

    Actions come from the model tokens (``turn_index``) of each row; observations from replaying the actions in
    a fresh environment of the task. Turns cut without ``<eos>`` (not in the training layout) are counted, not
    compared.
    """
    eos = tokenizer.eos_token_id
    task = dm.task
    compared, skipped, with_tool = 0, 0, 0
    dm.cursor = 0
    for step in range(steps):
        batch = dm.rollout(dm.prompt_batch(step))
        for row in range(batch.num_rows):
            ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
            turns = turn_ids(batch, row)
            if any(not t or t[-1] != eos for t in turns):
                skipped += 1
                continue
            actions = [tokenizer.decode(t[:-1], skip_special_tokens=True) for t in turns]
            env = task.make_env(batch.prompts[row], dm.reward_fn)
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
            with_tool += len(actions) > 1
    dm.cursor = 0
    if compared == 0 or with_tool == 0:
        raise SystemExit(f"layout check compared {compared} episodes, {with_tool} with a tool call: too few")
    return {"episodes_compared": compared, "episodes_with_a_tool_call": with_tool,
            "episodes_with_a_cut_turn": skipped}


def validate_with_library(out: Path) -> float:
    """``val/reward`` of ``Trainer.validate`` on ``GRPO(model_name_or_path=out)`` with the preset's data module."""
    return validate_episodes(out, RolloutDataModule(
        task=CalculatorTask(), max_new_tokens=MAX_NEW_TOKENS, val_batch_size=100,
        strategy=GroupRollout(max_turns=MAX_TURNS, max_episode_tokens=MAX_EPISODE_TOKENS)))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = args.out if args.out.is_absolute() else REPO_ROOT / args.out
    if not 0 < args.target_success <= args.max_success:
        raise SystemExit(f"need 0 < --target-success ({args.target_success}) <= --max-success ({args.max_success})")
    if not 0 <= args.tool_fraction <= 1:
        raise SystemExit(f"need 0 <= --tool-fraction ({args.tool_fraction}) <= 1")

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    model, tokenizer = build_tiny_policy(seed=args.seed, max_position_embeddings=MAX_POSITIONS)
    model.train()
    task = CalculatorTask()
    if task.max_calls + 1 != MAX_TURNS:
        raise SystemExit(f"CalculatorTask().max_calls={task.max_calls}: the preset's {MAX_TURNS} turns need 2")
    dm = make_datamodule(model, tokenizer, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(step: int) -> float:
        batch = make_batch(task, tokenizer, step, args.batch_size, args.seed, args.tool_fraction)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

    def evaluate() -> dict:
        model.eval()
        try:
            return heldout_tool_use(dm)
        finally:
            model.train()

    def accepted(stats: dict) -> bool:
        return (args.target_success <= stats["success"] <= args.max_success
                and args.min_tool_rate <= stats["tool_call_rate"] <= args.max_tool_rate
                and (stats["success_with_tool"] or 0.0) >= args.min_tool_success)

    history: list[dict] = [{"step": 0, **{k: v for k, v in evaluate().items() if k != "episodes"}}]
    step, loss, reached, stats = 0, float("nan"), False, history[0]
    bar = tqdm(total=args.max_steps, desc="warm start (calculator)", unit="step", dynamic_ncols=True)
    while step < args.max_steps:
        loss = train_step(step)
        step += 1
        bar.update(1)
        if step % args.eval_every:
            continue
        stats = evaluate()
        history.append({"step": step, "loss": round(loss, 4), **{k: v for k, v in stats.items() if k != "episodes"}})
        bar.write(f"step {step:5d}  loss {loss:.4f}  greedy held-out success {stats['success']:.3f}  tool calls "
                  f"{stats['tool_call_rate']:.2f} (right {stats['success_with_tool']}), direct right "
                  f"{stats['success_direct']}")
        bar.set_postfix(loss=f"{loss:.3f}", success=f"{stats['success']:.3f}", tool=f"{stats['tool_call_rate']:.2f}")
        if accepted(stats):
            reached = True
            break
    bar.close()
    if not reached:
        raise SystemExit(f"warm start found no evaluation with greedy success in [{args.target_success}, "
                         f"{args.max_success}], tool-call rate in [{args.min_tool_rate}, {args.max_tool_rate}] and "
                         f"tool-call success >= {args.min_tool_success} within --max-steps {args.max_steps} (last: {stats}); raise --max-steps or change the mix")
    train_seconds = time.perf_counter() - t0

    model.eval()
    success = greedy_success(dm)  # the validation path's own number (what val/reward logs)
    heldout = heldout_tool_use(dm)
    sampled = {**sampled_success(dm, args.sampled_steps),
               **{k: v for k, v in sampled_tool_use(dm, args.sampled_steps).items()
                  if k in ("tool_call_rate", "success_with_tool", "success_direct")}}
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
        "tool_fraction": args.tool_fraction,
        "episodes": "tool use (c<a>*<b>, then copy the calculator's result) or a direct answer, both right",
        "steps": step,
        "episodes_seen": step * args.batch_size,
        "heldout_greedy_success": success,
        "heldout_size": len(task.heldout_prompts()),
        "heldout_greedy": heldout,
        "sampled_success": sampled,
        "target_success": args.target_success,
        "max_success": args.max_success,
        "min_tool_rate": args.min_tool_rate,
        "max_tool_rate": args.max_tool_rate,
        "min_tool_success": args.min_tool_success,
        "eval_history": history,
        "layout_check": layout,
        "wall_time_s": round(time.perf_counter() - t0, 2),
        "train_time_s": round(train_seconds, 2),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "task": {"class": "CalculatorTask", "num_heldout": len(task.heldout), "max_calls": task.max_calls,
                 "seed": task.seed},
        "rollout": {"strategy": "GroupRollout", "max_turns": MAX_TURNS, "max_episode_tokens": MAX_EPISODE_TOKENS,
                    "max_new_tokens": MAX_NEW_TOKENS},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "command": "python experiments/warm_start_calculator.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    (out / "warm_start.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved to {out}: {step} steps, greedy held-out success {success:.3f} (reloaded {reloaded_success:.3f}, "
          f"Trainer.validate {library_success:.3f}), held-out {heldout}, sampled {sampled}, layout check {layout}, "
          f"{record['wall_time_s']:.1f}s")
    return record


if __name__ == "__main__":
    main()
