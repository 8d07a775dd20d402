"""What the warm-start scripts (``warm_start.py``, ``warm_start_guess.py``, ``warm_start_calculator.py``) share.

Each script keeps what is its own: its task, how it builds its training rows, what it evaluates and when it accepts
a checkpoint, and the fields of ``warm_start.json`` only it writes. Here are the rest:

* the command line: the parser, the options the scripts have in common, the ``--target-*`` / ``--max-*`` window
  and its check, the output directory;
* the tiny policy with its AdamW optimizer, the supervised step, and ``train``: the loop that evaluates every so
  often and stops at the first evaluation it accepts (rewinding and replaying on an overshoot);
* for the multi-turn tasks: the token layout of an episode (``episode_ids``), a task preset's data module
  (``EpisodePreset``), greedy and sampled success, and the check of the layout against real rollouts;
* saving, reloading, and the parts of ``warm_start.json`` every script writes.

The scripts import it as ``warm_start_common`` (``experiments/`` is on ``sys.path`` when they run); importing it puts
the repository root on ``sys.path``, so ``rl_lightning`` is the one of this checkout.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402

from rl_lightning.models.policy import build_tiny_policy  # noqa: E402
from rl_lightning.rollout import GroupRollout, RolloutBatch, RolloutDataModule, Sampling  # noqa: E402
from rl_lightning.rollout import Evaluation as EvalSettings  # noqa: E402

MAX_POSITIONS = 64  # the multi-turn warm starts' tiny Llama: max_position_embeddings

# ---------------------------------------------------------------------------------------------- command line
OPTIONS: dict[str, dict[str, Any]] = {  # the options more than one script has, exactly alike
    "--lr": dict(type=float, default=1e-3, help="AdamW learning rate (constant)"),
    "--max-steps": dict(type=int, default=3000),
    "--sampled-steps": dict(type=int, default=8, help="training batches (16 prompts x 8 episodes, temperature 1) "
                                                      "the sampled success is measured on"),
    "--no-refine": dict(dest="refine", action="store_false",
                        help="on overshoot, fail at once instead of replaying the last interval step by step"),
}
OUT_HELP = "output directory (relative paths are taken from the repository root)"


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first paragraph as the description, defaults in the help."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_options(p: argparse.ArgumentParser, *flags: str) -> None:
    """Add the shared ``OPTIONS`` named by ``flags``, in that order."""
    for flag in flags:
        p.add_argument(flag, **OPTIONS[flag])


def add_window_options(p: argparse.ArgumentParser, metric: str, low_help: str = "stop at the first eval at or above "
                       "this", high_help: str = "fail if the first eval >= target exceeds this") -> None:
    """``--target-<metric>`` (default 0.30) and ``--max-<metric>`` (0.50): the window a warm start must land in."""
    p.add_argument(f"--target-{metric}", type=float, default=0.30, help=low_help)
    p.add_argument(f"--max-{metric}", type=float, default=0.50, help=high_help)


def check_window(args: argparse.Namespace, metric: str) -> tuple[float, float]:
    """``(target, max)`` of ``metric``; exits unless ``0 < target <= max``."""
    low, high = getattr(args, f"target_{metric}"), getattr(args, f"max_{metric}")
    if not 0 < low <= high:
        raise SystemExit(f"need 0 < --target-{metric} ({low}) <= --max-{metric} ({high})")
    return low, high


def output_dir(out: Path) -> Path:
    """``--out``, a relative path taken from the repository root."""
    return out if out.is_absolute() else REPO_ROOT / out


# ---------------------------------------------------------------------------------------------- training
def tiny_policy(seed: int, lr: float, **config_overrides: int
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, torch.optim.Optimizer]:
    """The seeded tiny Llama (in training mode, deterministic algorithms on), its tokenizer and AdamW at ``lr``."""
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    model, tokenizer = build_tiny_policy(seed=seed, **config_overrides)
    model.train()
    return model, tokenizer, torch.optim.AdamW(model.parameters(), lr=lr)


def supervised_step(model: PreTrainedModel, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    """One step on ``batch`` (``input_ids`` / ``attention_mask`` / ``labels``); the loss."""
    loss = model(**batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def padded_batch(rows: list[list[int]], label_rows: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` / ``labels`` (-100 on padding) of token-id rows."""
    width = max(len(r) for r in rows)
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([r + [-100] * (width - len(r)) for r in label_rows]),
    }


class Evaluation(NamedTuple):
    """What one evaluation found."""

    score: float  # the number the window is about
    entry: dict  # its ``eval_history`` entry (after ``"step"``)
    text: str  # what its progress line says after the step and the loss
    postfix: dict[str, str]  # the progress bar's postfix (besides the loss)
    stats: Any = None  # anything else the script wants back


@dataclass
class Run:
    """How ``train`` ended: at ``step``, accepted (``reached``), ``overshot``, or neither (out of steps)."""

    step: int
    loss: float
    history: list[dict]
    last: Evaluation
    reached: bool
    overshot: bool
    refined: bool


def train(model: PreTrainedModel, optimizer: torch.optim.Optimizer, train_step: Callable[[int], float],
          evaluate: Callable[[float | None], Evaluation], *, desc: str, max_steps: int,
          interval: Callable[[float], int], window: tuple[float, float] | None = None, min_steps: int = 0,
          accept: Callable[[Evaluation], bool] | None = None, refine: bool = False,
          postfix_every: int | None = None) -> Run:
    """Train step by step (``train_step(step)`` returns the loss) until an evaluation is accepted.

    ``evaluate(loss)`` runs before the first step (``loss`` None) and then every ``interval(score)`` steps (given the
    last score). From ``min_steps`` on, an evaluation whose score is in ``window`` ``[low, high]`` is accepted (or,
    without a window, one that ``accept`` holds for); a score above ``high`` overshoots. On an overshoot with
    ``refine`` (and more than one step since the last evaluation) the weights and optimizer state of the last
    evaluation come back and the same steps are replayed (batches are a pure function of the step index), with
    an evaluation after every one; any other overshoot ends the run (``Run.overshot``).
    """
    history: list[dict] = []
    last = evaluate(None)
    history.append({"step": 0, **last.entry})
    next_eval = interval(last.score)
    snapshot = (0, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())) if refine else None
    step, loss, reached, overshot, refining = 0, float("nan"), False, False, False
    bar = tqdm(total=max_steps, desc=desc, unit="step", dynamic_ncols=True)
    if postfix_every:
        bar.set_postfix(**last.postfix)
    while step < max_steps:
        loss = train_step(step)
        step += 1
        bar.update(1)
        if postfix_every and step % postfix_every == 0:
            bar.set_postfix(loss=f"{loss:.3f}", **last.postfix)
        if step < next_eval:
            continue
        last = evaluate(loss)
        history.append({"step": step, **last.entry, **({"refine": True} if refining else {})})
        bar.write(f"step {step:5d}  loss {loss:.4f}  {last.text}" + ("  (refine)" if refining else ""))
        bar.set_postfix(loss=f"{loss:.3f}", **last.postfix)
        if step >= min_steps and (accept(last) if window is None else window[0] <= last.score <= window[1]):
            reached = True
            break
        if window is not None and step >= min_steps and last.score > window[1]:
            if snapshot is not None and not refining and step - snapshot[0] > 1:
                start, model_state, optim_state = snapshot
                bar.write(f"overshot ({last.score:.3f} > {window[1]}); replaying steps {start + 1}..{step} "
                          "with an evaluation after each")
                model.load_state_dict(model_state)
                optimizer.load_state_dict(optim_state)
                bar.update(start - step)
                step, refining, next_eval = start, True, start + 1
                continue
            overshot = True
            break
        next_eval = step + (1 if refining else interval(last.score))
        if snapshot is not None and not refining:
            snapshot = (step, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
    bar.close()
    return Run(step, loss, history, last, reached, overshot, refining)


# ---------------------------------------------------------------------------------------------- episodes
def episode_rng(seed: int, index: int) -> random.Random:
    """The random stream of training episode ``index`` (a pure function of seed and index)."""
    return random.Random((seed * 1_000_003 + index) * 31 + 17)


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


def episode_batch(tokenizer: PreTrainedTokenizerBase, episodes: Iterable[tuple[str, list[str], list[str]]]
                  ) -> dict[str, torch.Tensor]:
    """Right-padded ``(first observation, actions, observations)`` episodes in the layout of ``episode_ids``
    (positions 0..n-1 on the real tokens, as in left-padded generation)."""
    rows, label_rows = [], []
    for episode in episodes:
        ids, labels = episode_ids(tokenizer, *episode)
        if len(ids) > MAX_POSITIONS:
            raise SystemExit(f"an episode of {len(ids)} tokens does not fit in {MAX_POSITIONS} positions")
        rows.append(ids)
        label_rows.append(labels)
    return padded_batch(rows, label_rows, tokenizer.pad_token_id)


def turn_ids(batch: RolloutBatch, row: int) -> list[list[int]]:
    """The ids the model sampled in each turn of episode ``row`` (``<eos>`` included where the turn closed)."""
    response = batch.input_ids[row, batch.prompt_length:].tolist()
    turn_index = batch.turns.index[row].tolist()
    return [[tok for tok, t in zip(response, turn_index) if t == k] for k in range(int(batch.turns.count[row]))]


@dataclass(frozen=True)
class EpisodePreset:
    """The data settings of a multi-turn task's preset (``configs/tasks/<name>.yaml``)."""

    task: Callable[[], Any]  # builds the task, e.g. ``GuessNumberTask``
    val_batch_size: int
    max_new_tokens: int
    max_turns: int
    max_episode_tokens: int

    def strategy(self) -> GroupRollout:
        return GroupRollout(max_turns=self.max_turns, max_episode_tokens=self.max_episode_tokens)

    def datamodule(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, seed: int = 0
                   ) -> RolloutDataModule:
        """The preset's data module with the method configs' 16 prompts x 8 episodes, attached to ``model``
        through a stand-in trainer so its rollouts can be called directly."""
        dm = RolloutDataModule(task=self.task(), prompts_per_step=16, group_size=8, seed=seed,
                               strategy=self.strategy(), sampling=Sampling(max_new_tokens=self.max_new_tokens),
                               evaluation=EvalSettings(batch_size=self.val_batch_size))
        dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(policy=model, tokenizer=tokenizer),
                                     global_rank=0, world_size=1)
        return dm

    def library_reward(self, out: Path) -> float:
        """``val/reward`` of ``Trainer.validate`` on ``GRPO(model_name_or_path=out)`` with the preset's data module."""
        import lightning.pytorch as pl

        from rl_lightning.algorithms import GRPO

        module = GRPO(model_name_or_path=str(out))
        dm = RolloutDataModule(task=self.task(), strategy=self.strategy(),
                               sampling=Sampling(max_new_tokens=self.max_new_tokens),
                               evaluation=EvalSettings(batch_size=self.val_batch_size))
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.validate(module, datamodule=dm, verbose=False)
        return float(trainer.callback_metrics["val/reward"])

    def check_saved(self, out: Path, success: float) -> tuple[float, float]:
        """Reload ``out`` as the package will and re-score it, directly and through ``Trainer.validate``; both
        must give ``success``. Returns ``(reloaded, Trainer.validate)``."""
        reloaded, reloaded_tok = reload(out)
        reloaded_success = greedy_success(self.datamodule(reloaded, reloaded_tok))
        library_success = self.library_reward(out)
        if max(abs(reloaded_success - success), abs(library_success - success)) > 1e-6:  # val/reward is float32
            raise SystemExit(f"reloaded checkpoint scores {reloaded_success:.4f} (Trainer.validate: "
                             f"{library_success:.4f}), expected {success:.4f}")
        return reloaded_success, library_success

    def record(self) -> dict:
        return {"strategy": "GroupRollout", "max_turns": self.max_turns, "max_episode_tokens": self.max_episode_tokens,
                "max_new_tokens": self.max_new_tokens}


@torch.no_grad()
def greedy_success(dm: RolloutDataModule) -> float:
    """Mean held-out reward of the data module's greedy rollouts (what ``val/reward`` logs)."""
    total, count = dm.evaluate()
    return total / count


def training_rollouts(dm: RolloutDataModule, steps: int) -> Iterable[RolloutBatch]:
    """Temperature-1 rollouts of the first ``steps`` training batches; the prompt stream is rewound before and
    after, so training (and the next measurement) sees the same stream."""
    dm.cursor = 0
    for step in range(steps):
        yield dm.rollout(dm.prompt_batch(step))
    dm.cursor = 0


@torch.no_grad()
def sampled_success(dm: RolloutDataModule, steps: int) -> dict:
    """Temperature-1 rollouts of the first ``steps`` training batches: mean reward, and the fraction of groups
    whose rewards are all equal (all found or none: zero advantage under GRPO)."""
    rewards, flat_groups = [], 0
    for batch in training_rollouts(dm, steps):
        r = batch.rewards.view(-1, batch.group_size)
        rewards.append(r)
        flat_groups += int((r.max(dim=1).values == r.min(dim=1).values).sum())
    r = torch.cat(rewards)
    return {"success": round(float(r.mean()), 4), "episodes": r.numel(), "groups": r.shape[0],
            "constant_group_fraction": round(flat_groups / r.shape[0], 4),
            "all_zero_group_fraction": round(float((r.max(dim=1).values == 0).float().mean()), 4)}


@torch.no_grad()
def check_layout(dm: RolloutDataModule, tokenizer: PreTrainedTokenizerBase, steps: int = 2, *,
                 skip_special_tokens: bool = False) -> tuple[list[list[str]], int, int]:
    """Rebuild sampled rollouts' ids with ``episode_ids`` and compare with ``RolloutBatch.input_ids``.

    Actions come from the model tokens (``turns.index``) of each row; observations from replaying the actions in
    a fresh environment of the task (its return must be the rollout's reward). Episodes with a turn cut without
    ``<eos>`` (not in the training layout) are counted, not compared; so are, with ``skip_special_tokens``, those
    with a sampled special token inside a turn (its text is not its ids). Exits on the first difference.
    Returns ``(the actions of every episode compared, episodes with a cut turn, episodes with a special token)``.
    """
    eos = tokenizer.eos_token_id
    compared, skipped, special = [], 0, 0
    for step, batch in enumerate(training_rollouts(dm, steps)):
        for row in range(batch.num_rows):
            ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
            turns = turn_ids(batch, row)
            if any(not t or t[-1] != eos for t in turns):
                skipped += 1
                continue
            actions = [tokenizer.decode(t[:-1], skip_special_tokens=True) for t in turns]
            if skip_special_tokens and any(tokenizer(a, add_special_tokens=False)["input_ids"] != t[:-1]
                                           for a, t in zip(actions, turns)):
                special += 1
                continue
            env = dm.task.make_env(batch.prompts[row], dm.reward_fn)
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
            compared.append(actions)
    return compared, skipped, special


# ---------------------------------------------------------------------------------------------- saving
def save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """The model (safetensors) and the tokenizer into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def reload(out: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The saved model and tokenizer, loaded exactly as the package will."""
    return (AutoModelForCausalLM.from_pretrained(out, local_files_only=True),
            AutoTokenizer.from_pretrained(out, local_files_only=True))


def settings_record(args: argparse.Namespace) -> dict:
    """The first fields of ``warm_start.json``: seed and optimizer settings."""
    return {"seed": args.seed, "lr": args.lr, "batch_size": args.batch_size, "optimizer": "AdamW"}


def timing_record(t0: float, train_seconds: float, model: PreTrainedModel) -> dict:
    """Wall and training time (since ``t0``, before building the model) and the number of parameters."""
    return {"wall_time_s": round(time.perf_counter() - t0, 2), "train_time_s": round(train_seconds, 2),
            "num_parameters": sum(p.numel() for p in model.parameters())}


def provenance_record(script: str, argv: list[str] | None) -> dict:
    """The last fields of ``warm_start.json``: library versions and the command that made it."""
    return {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "command": f"python experiments/{Path(script).name} " + " ".join(sys.argv[1:] if argv is None else argv),
    }


def finish(out: Path, record: dict, summary: str) -> dict:
    """Write ``record`` as ``out/warm_start.json`` and say so with ``summary`` and the wall time."""
    (out / "warm_start.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved to {out}: {summary}, {record['wall_time_s']:.1f}s")
    return record
