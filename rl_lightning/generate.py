"""``rl-lightning generate <run, checkpoint or config> --out samples.jsonl``: k samples per prompt, scored, to JSONL,
with mean@k and pass@k.

The model is the run's (its ``config.yaml`` and last checkpoint, as ``export`` finds them) or, for a config file,
the initial weights it names. The prompts are the task's held-out split (``--split test|validation``) or a JSONL
file of ``{"prompt": ..., "answer": ...}`` lines (``--prompts``; answers optional: a prompt without one is written
unscored). Each prompt gets ``--n`` samples with the run's sampling settings (``temperature``, ``top_p``,
``max_new_tokens``; overridable), or one greedy response (``--greedy``). Every sample is one JSON line: prompt,
answer, sample index, response, reward, whether it was cut at the token limit, its length. The summary line gives the
mean reward (mean@n) and pass@k for each ``--k`` (a sample passes when its reward is at least ``--pass_reward``),
with the unbiased estimator (``functional.pass_at_k``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl_lightning.envs.base import Prompt, RewardFunction
from rl_lightning.envs.jsonl import PromptFileError, read_prompt_file
from rl_lightning.export import ExportError, locate_run
from rl_lightning.functional.errors import ConfigError
from rl_lightning.functional.evaluation import pass_at_k
from rl_lightning.rollout.batch import PromptBatch
from rl_lightning.runs import CheckpointError, read_checkpoint, run_settings


class _ScoredIfAnswered(RewardFunction):
    """The run's reward for a prompt with an answer; 0 (written as unscored) for one without."""

    def __init__(self, inner: RewardFunction) -> None:
        self.inner = inner

    def __call__(self, prompt: Prompt, response: str) -> float:
        return self.inner(prompt, response) if prompt.answer is not None else 0.0


def _build(source: Path, build_cli: Callable[..., Any], overrides: dict[str, Any]) -> tuple[Any, Any, str]:
    """``(module, data module, what weights)`` of a run directory, a checkpoint in one, or a config file."""
    checkpoint = None
    if source.is_file() and source.suffix in (".yaml", ".yml"):
        config = source
    else:
        run_dir, checkpoint_path = locate_run(source)
        config, checkpoint = run_dir / "config.yaml", (checkpoint_path, read_checkpoint(checkpoint_path))
    settings = run_settings(config, logger=False, enable_progress_bar=False, enable_checkpointing=False, callbacks=None)
    settings["data"].setdefault("init_args", {}).setdefault("sampling", {}).update(overrides)
    cli = build_cli(settings, run=False, save_config=False)
    module, data = cli.model, cli.datamodule
    if checkpoint is None:
        where = f"the initial weights of {module.hparams.get('model_name_or_path')}"
    else:
        module.load_state_dict(checkpoint[1]["state_dict"])
        where = f"{checkpoint[0]} (step {int(checkpoint[1].get('global_step', 0))})"
    module.policy.eval()
    data.bind(module.policy, module.tokenizer)
    return module, data, where


def generate(source: str | Path, out: str | Path, build_cli: Callable[..., Any], n: int = 1,
             ks: list[int] | None = None, prompts_file: str | None = None, split: str = "test", greedy: bool = False,
             limit: int | None = None, pass_reward: float = 1.0, overrides: dict[str, Any] | None = None) -> str:
    """Write the samples (see the module docstring) and return the summary line. Raises ``ExportError``,
    ``CheckpointError``, ``ConfigError`` or ``PromptFileError`` with one line."""
    if n < 1 or (greedy and n != 1):
        raise ConfigError(f"--n {n}: must be >= 1 (and 1 with --greedy)")
    ks = sorted(set(ks or ([1, n] if n > 1 else [1])))
    if any(not 1 <= k <= n for k in ks):
        raise ConfigError(f"--k {ks}: each k must be in 1..n (n={n})")
    module, data, where = _build(Path(source), build_cli, dict(overrides or {}))
    if prompts_file is not None:
        prompts = read_prompt_file(prompts_file, require_answer=False)
        data.reward_fn = _ScoredIfAnswered(data.reward_fn)
    else:
        prompts = data.task.heldout_prompts() if split == "test" else data.task.validation_prompts()
    prompts = prompts[:limit] if limit is not None else prompts
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rewards: list[list[float]] = []
    chunk = max(1, data.evaluation.batch_size // n)
    with out.open("w") as fh:
        for start in range(0, len(prompts), chunk):
            part = prompts[start:start + chunk]
            batch = (data.rollout(PromptBatch("val", -1, list(range(len(part))), part)) if greedy
                     else data.sample(part, n))
            for row in range(batch.num_rows):
                prompt = part[row // n]
                reward = float(batch.rewards[row]) if prompt.answer is not None else None
                fh.write(json.dumps({"prompt": prompt.text, "answer": prompt.answer, "sample": row % n,
                                     "response": batch.responses[row], "reward": reward,
                                     "truncated": bool(batch.truncated[row]),
                                     "length": int(batch.response_lengths[row])}) + "\n")
            rewards += [[float(r) for r in batch.rewards[i * n:(i + 1) * n]] for i, p in enumerate(part)
                        if p.answer is not None]
    mode = "greedy" if greedy else f"{n} sample{'s' if n > 1 else ''} each"
    line = f"{len(prompts)} prompts x {mode} from {where} -> {out}"
    if rewards:
        mean = sum(map(sum, rewards)) / (len(rewards) * n)
        passes = ", ".join(
            f"pass@{k} {sum(pass_at_k(n, sum(r >= pass_reward for r in rs), k) for rs in rewards) / len(rewards):.3f}"
            for k in ks)
        line += f"; mean@{n} reward {mean:.3f}, {passes} on {len(rewards)} scored prompts"
    return line


def generate_main(argv: list[str], build_cli: Callable[..., Any]) -> int:
    """The ``rl-lightning generate`` subcommand."""
    parser = argparse.ArgumentParser(prog="rl-lightning generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a run directory, a checkpoint file in one, or a config file (initial weights)")
    parser.add_argument("--out", required=True, help="the JSONL file to write, one line per sample")
    parser.add_argument("--prompts", help="a JSONL file of prompts (answers optional); default: the task's split")
    parser.add_argument("--split", default="test", choices=["test", "validation"], help="the task's held-out split")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--k", type=int, nargs="+", help="pass@k for these k (default: 1 and n)")
    parser.add_argument("--greedy", action="store_true", help="one greedy response per prompt")
    parser.add_argument("--limit", type=int, help="the first LIMIT prompts only")
    parser.add_argument("--pass_reward", type=float, default=1.0, help="a sample passes with a reward >= this")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top_p", type=float)
    parser.add_argument("--max_new_tokens", type=int)
    args = parser.parse_args(argv)
    overrides = {k: v for k in ("temperature", "top_p", "max_new_tokens") if (v := getattr(args, k)) is not None}
    try:
        line = generate(args.source, args.out, build_cli, args.n, args.k, args.prompts, args.split, args.greedy,
                        args.limit, args.pass_reward, overrides)
    except (ExportError, CheckpointError, ConfigError, PromptFileError) as err:
        print(f"rl-lightning generate: error: {err}", file=sys.stderr)
        return 2
    print(f"rl-lightning: {line}")
    return 0
