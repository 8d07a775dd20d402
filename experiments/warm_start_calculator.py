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
template, ``add_bos``), built by ``episode_ids`` of ``experiments/warm_start_common.py``: ``<bos>`` + the first
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

Reproduce (from the repository root)::

    .venv/bin/python experiments/warm_start_calculator.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Iterable

EXPERIMENTS = str(Path(__file__).resolve().parent)
if EXPERIMENTS not in sys.path:
    sys.path.insert(0, EXPERIMENTS)

import torch  # noqa: E402
import warm_start_common as common  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402

from rl_lightning.envs.calculator import CalculatorTask  # noqa: E402
from rl_lightning.rollout import RolloutBatch, RolloutDataModule  # noqa: E402

# configs/tasks/calculator.yaml: max_new_tokens "c99*9" + <eos>; GroupRollout(max_turns = CalculatorTask.max_calls
# + 1, max_episode_tokens: 3 turns of 6 + 2 observations of <= 7 ("=99999:"))
PRESET = common.EpisodePreset(CalculatorTask, val_batch_size=100, max_new_tokens=6, max_turns=3, max_episode_tokens=32)
DEFAULT_OUT = Path("rl_lightning/models/assets/calculator")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--seed", type=int, default=0, help="seeds the model init, the episode mix and all torch randomness")
    p.add_argument("--tool-fraction", type=float, default=0.3, help="share of training episodes that use the tool")
    common.add_options(p, "--lr")
    p.add_argument("--batch-size", type=int, default=64, help="episodes per step")
    p.add_argument("--eval-every", type=int, default=10, help="steps between greedy held-out evaluations")
    common.add_window_options(p, "success", "lowest greedy held-out success accepted",
                              "highest greedy held-out success accepted")
    p.add_argument("--min-tool-rate", type=float, default=0.10,
                   help="lowest greedy held-out tool-call rate accepted (RL needs tool calls to reinforce)")
    p.add_argument("--min-tool-success", type=float, default=0.90,
                   help="lowest greedy success of the held-out episodes that call the tool (copying is learned)")
    p.add_argument("--max-tool-rate", type=float, default=0.50,
                   help="highest greedy held-out tool-call rate accepted (the policy must still answer directly)")
    common.add_options(p, "--max-steps", "--sampled-steps")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=common.OUT_HELP)
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
    return common.episode_rng(seed, index).random() < tool_fraction


def make_batch(task: CalculatorTask, tokenizer: PreTrainedTokenizerBase, step: int, batch_size: int, seed: int,
               tool_fraction: float) -> dict[str, torch.Tensor]:
    """Right-padded training episodes in the rollout's layout (``common.episode_ids``)."""
    indices = range(step * batch_size, (step + 1) * batch_size)
    return common.episode_batch(tokenizer, (demo_episode(task, i, uses_tool(i, seed, tool_fraction)) for i in indices))


# ---------------------------------------------------------------------------------------------- evaluation
def called_tool(batch: RolloutBatch, tokenizer: PreTrainedTokenizerBase) -> list[bool]:
    """Per episode: whether its first turn is a tool call (starts with ``c``)."""
    return [tokenizer.decode(common.turn_ids(batch, row)[0], skip_special_tokens=True).strip().startswith("c")
            for row in range(batch.num_rows)]


@torch.no_grad()
def tool_use(tokenizer: PreTrainedTokenizerBase, rollouts: Iterable[RolloutBatch]) -> dict:
    """Tool-call rate, success, and success split by whether the episode called the tool, over ``rollouts``."""
    tool, reward = [], []
    for batch in rollouts:
        tool += called_tool(batch, tokenizer)
        reward += batch.rewards.tolist()
    with_tool = [r for t, r in zip(tool, reward) if t]
    direct = [r for t, r in zip(tool, reward) if not t]
    return {"episodes": len(tool), "success": round(sum(reward) / len(reward), 4),
            "tool_call_rate": round(sum(tool) / len(tool), 4),
            "success_with_tool": round(sum(with_tool) / len(with_tool), 4) if with_tool else None,
            "success_direct": round(sum(direct) / len(direct), 4) if direct else None}


def heldout_tool_use(dm: RolloutDataModule) -> dict:
    """``tool_use`` of the greedy held-out rollouts."""
    return tool_use(dm.tokenizer, (dm.rollout(batch) for batch in dm.val_prompt_batches()))


def check_layout(dm: RolloutDataModule, tokenizer: PreTrainedTokenizerBase) -> dict:
    """``common.check_layout`` on sampled rollouts, of which some must call the tool."""
    compared, cut, _ = common.check_layout(dm, tokenizer)
    with_tool = sum(len(actions) > 1 for actions in compared)
    if not compared or not with_tool:
        raise SystemExit(f"layout check compared {len(compared)} episodes, {with_tool} with a tool call: too few")
    return {"episodes_compared": len(compared), "episodes_with_a_tool_call": with_tool,
            "episodes_with_a_cut_turn": cut}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = common.output_dir(args.out)
    common.check_window(args, "success")
    if not 0 <= args.tool_fraction <= 1:
        raise SystemExit(f"need 0 <= --tool-fraction ({args.tool_fraction}) <= 1")

    t0 = time.perf_counter()
    model, tokenizer, optimizer = common.tiny_policy(args.seed, args.lr, max_position_embeddings=common.MAX_POSITIONS)
    task = CalculatorTask()
    if task.max_calls + 1 != PRESET.max_turns:
        raise SystemExit(f"CalculatorTask().max_calls={task.max_calls}: the preset's {PRESET.max_turns} turns need 2")
    dm = PRESET.datamodule(model, tokenizer, seed=args.seed)

    def evaluate(loss: float | None) -> common.Evaluation:
        model.eval()
        try:
            stats = heldout_tool_use(dm)
        finally:
            model.train()
        entry = {k: v for k, v in stats.items() if k != "episodes"}
        text = (f"greedy held-out success {stats['success']:.3f}  tool calls {stats['tool_call_rate']:.2f} (right "
                f"{stats['success_with_tool']}), direct right {stats['success_direct']}")
        postfix = {"success": f"{stats['success']:.3f}", "tool": f"{stats['tool_call_rate']:.2f}"}
        return common.Evaluation(stats["success"], entry if loss is None else {"loss": round(loss, 4), **entry}, text,
                                 postfix, stats)

    def accepted(evaluation: common.Evaluation) -> bool:
        stats = evaluation.stats
        return (args.target_success <= stats["success"] <= args.max_success
                and args.min_tool_rate <= stats["tool_call_rate"] <= args.max_tool_rate
                and (stats["success_with_tool"] or 0.0) >= args.min_tool_success)

    run = common.train(model, optimizer,
                       lambda step: common.supervised_step(model, optimizer, make_batch(
                           task, tokenizer, step, args.batch_size, args.seed, args.tool_fraction)),
                       evaluate, desc="warm start (calculator)", max_steps=args.max_steps,
                       interval=lambda _: args.eval_every, accept=accepted)
    step = run.step
    if not run.reached:
        last = run.last.stats if len(run.history) > 1 else run.history[0]
        raise SystemExit(f"warm start found no evaluation with greedy success in [{args.target_success}, "
                         f"{args.max_success}], tool-call rate in [{args.min_tool_rate}, {args.max_tool_rate}] and "
                         f"tool-call success >= {args.min_tool_success} within --max-steps {args.max_steps} (last: "
                         f"{last}); raise --max-steps or change the mix")
    train_seconds = time.perf_counter() - t0

    model.eval()
    success = common.greedy_success(dm)  # the validation path's own number (what val/reward logs)
    heldout = heldout_tool_use(dm)
    sampled = {**common.sampled_success(dm, args.sampled_steps),
               **{k: v for k, v in tool_use(tokenizer, common.training_rollouts(dm, args.sampled_steps)).items()
                  if k in ("tool_call_rate", "success_with_tool", "success_direct")}}
    layout = check_layout(dm, tokenizer)
    common.save(model, tokenizer, out)
    reloaded_success, library_success = PRESET.check_saved(out, success)

    record = {
        **common.settings_record(args),
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
        "eval_history": run.history,
        "layout_check": layout,
        **common.timing_record(t0, train_seconds, model),
        "task": {"class": "CalculatorTask", "num_heldout": len(task.heldout), "max_calls": task.max_calls,
                 "seed": task.seed},
        "rollout": PRESET.record(),
        **common.provenance_record(__file__, argv),
    }
    return common.finish(out, record, f"{step} steps, greedy held-out success {success:.3f} (reloaded "
                                      f"{reloaded_success:.3f}, Trainer.validate {library_success:.3f}), held-out "
                                      f"{heldout}, sampled {sampled}, layout check {layout}")


if __name__ == "__main__":
    main()
