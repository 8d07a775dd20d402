"""``DatasetTask``: single-turn prompts from a local Hugging Face ``datasets`` dataset (parquet, arrow, JSON/JSONL
files, or a directory written by ``save_to_disk``), never downloaded.

A row becomes a prompt through a column mapping: the prompt is ``prompt_column``'s text (or ``template`` formatted
with the row's columns, e.g. ``"{question}\\nPut the answer in \\\\boxed{{}}."``), or ``messages_column``'s chat
messages (``[{"role": ..., "content": ...}]``); ``system_prompt`` adds a system message. The answer is
``answer_column``'s value, read by the task's reward. GSM8K's own rows (``{"question", "answer": "<work> #### 42"}``)
work as they are: the defaults read ``question`` and ``answer``, and the default reward (``MathVerifyReward``, with
``NumericAnswerReward`` as its fallback) takes what follows ``####``.

Chat messages (a ``messages_column`` or a ``system_prompt``) are kept in the prompt's metadata (``messages``) and
rendered by the tokenizer's chat template, so they need ``data.prompt_format.use_chat_template: true`` (refused
otherwise).
"""

from __future__ import annotations

import os
import random
import string
from pathlib import Path
from typing import Any

from rl_lightning.envs.base import MESSAGES, Prompt, PromptListTask, RewardFunction
from rl_lightning.envs.verifiers import MathVerifyReward
from rl_lightning.functional.errors import ConfigError

#: file suffixes and the ``datasets`` builder that reads them
FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def load_local_dataset(path: str | Path, split: str = "train") -> Any:
    """A ``datasets.Dataset`` from a local file (by suffix: ``FORMATS``) or a ``save_to_disk`` directory (a
    ``DatasetDict``'s ``split``); one ``ConfigError`` line for anything else, never a download."""
    try:
        import datasets
    except ImportError:
        raise ConfigError('DatasetTask needs the datasets package: pip install -e ".[data]"') from None
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    local = Path(path).expanduser()
    if local.is_dir():
        loaded = datasets.load_from_disk(str(local))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(f"{path}: no split {split!r} in the saved dataset (splits: {sorted(loaded)})")
            return loaded[split]
        return loaded
    if local.is_file():
        builder = FORMATS.get(local.suffix.lower())
        if builder is None:
            raise ConfigError(f"{path}: unknown data file type {local.suffix!r} (one of {', '.join(FORMATS)}, or a "
                              f"directory written by save_to_disk)")
        return datasets.load_dataset(builder, data_files=str(local), split="train")
    raise ConfigError(f"{path}: no such file or directory (datasets are never downloaded at run time: download it "
                      f"yourself, e.g. with datasets.load_dataset(...).save_to_disk(dir), then pass the local path)")


class DatasetTask(PromptListTask):
    """Prompts from a local dataset, reshuffled every pass with ``seed``; a held-out test split and an optional
    validation split, from files of their own or carved from the training file (see the module docstring).

    Args:
        train_path: the training data (a file or a ``save_to_disk`` directory).
        heldout_path: the test split's data; when omitted, ``num_heldout`` rows of ``train_path`` are held out.
        validation_path: the validation split's data; when omitted, ``num_validation`` rows are held out.
        num_heldout, num_validation: rows carved from ``train_path`` (a seeded shuffle; never trained on).
        split: the split of a ``save_to_disk`` directory (``DatasetDict``) to read.
        prompt_column, answer_column: the columns of the prompt text and the reference answer.
        messages_column: a column of chat messages to use as the prompt instead of ``prompt_column``.
        template: the prompt as a format string over the row's columns (``{question}``); ``None``: the column.
        system_prompt: a system message put before the prompt (needs the chat template).
        seed: seeds the split and the shuffles.
        reward: the default verifier (``MathVerifyReward()`` when ``None``); ``data.reward_fn`` overrides it.
    """

    def __init__(self, train_path: str, heldout_path: str | None = None, validation_path: str | None = None,
                 num_heldout: int = 0, num_validation: int = 0, split: str = "train", prompt_column: str = "question",
                 answer_column: str = "answer", messages_column: str | None = None, template: str | None = None,
                 system_prompt: str | None = None, seed: int = 1234, reward: RewardFunction | None = None) -> None:
        for name, value in (("num_heldout", num_heldout), ("num_validation", num_validation)):
            if value < 0:
                raise ConfigError(f"DatasetTask: {name}={value} must be >= 0")
        self.prompt_column, self.answer_column, self.messages_column = prompt_column, answer_column, messages_column
        self.template, self.system_prompt, self.reward, self.split = template, system_prompt, reward, split
        rows = self._prompts(train_path)
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        carve = (0 if heldout_path else num_heldout) + (0 if validation_path else num_validation)
        if carve >= len(rows):
            raise ConfigError(f"DatasetTask: holding out {carve} rows leaves no training row in {train_path} "
                              f"({len(rows)} rows)")
        cut = len(rows) - carve
        rest = [rows[i] for i in order[cut:]]
        held = 0 if heldout_path else num_heldout
        heldout = self._prompts(heldout_path) if heldout_path else rest[:held]
        self._validation = self._prompts(validation_path) if validation_path else rest[held:]
        super().__init__([rows[i] for i in order[:cut]], heldout, seed)

    def needs_chat_template(self) -> bool:
        """Whether the prompts carry chat messages (a messages column or a system prompt)."""
        return self.messages_column is not None or self.system_prompt is not None

    def _prompts(self, path: str) -> list[Prompt]:
        data = load_local_dataset(path, self.split)
        needed = [c for c in (self.messages_column or self.prompt_column, self.answer_column) if c is not None]
        if self.template is not None:
            needed += [f for _, f, _, _ in string.Formatter().parse(self.template) if f]
        missing = sorted(set(needed) - set(data.column_names))
        if missing:
            raise ConfigError(f"{path}: no column {', '.join(map(repr, missing))} (columns: {data.column_names}); "
                              f"map yours with prompt_column, answer_column, messages_column or template")
        return [self._prompt(row, f"{path} row {i}") for i, row in enumerate(data)]

    def _prompt(self, row: dict[str, Any], where: str) -> Prompt:
        answer = row.get(self.answer_column)
        if answer is None:
            raise ConfigError(f"{where}: the answer column {self.answer_column!r} is empty")
        messages: list[dict[str, str]] | None = None
        if self.messages_column is not None:
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in row[self.messages_column]]
            users = [m["content"] for m in messages if m["role"] == "user"]
            if not users:
                raise ConfigError(f"{where}: the messages in {self.messages_column!r} hold no user message")
            text = users[-1]
        else:
            text = self.template.format(**row) if self.template is not None else str(row[self.prompt_column])
        if self.system_prompt is not None:
            messages = [{"role": "system", "content": self.system_prompt},
                        *(messages or [{"role": "user", "content": text}])]
        metadata = {MESSAGES: messages} if messages is not None else {}
        return Prompt(text, str(answer), metadata)

    def validation_prompts(self) -> list[Prompt]:
        if not self._validation:
            raise NotImplementedError("DatasetTask has no validation split (set validation_path or num_validation)")
        return list(self._validation)

    def default_reward(self) -> RewardFunction:
        return self.reward if self.reward is not None else MathVerifyReward()
