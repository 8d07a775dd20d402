"""Users' own single-turn data: JSONL files with one ``{"prompt": ..., "answer": ...}`` object per line."""

from __future__ import annotations

import json
import random
from pathlib import Path

from rl_lightning.envs.base import Prompt, PromptListTask


class PromptFileError(ValueError):
    """A malformed prompt file: the message names the file, the line number and what is wrong."""


def read_prompt_file(path: str | Path, require_answer: bool = True) -> list[Prompt]:
    """Read a JSONL prompt file; every other key of a line is kept as metadata.

    Blank lines are skipped. Raises ``PromptFileError`` naming ``path:line`` for invalid JSON, a line that is
    not an object, a missing or non-string ``prompt``, or a missing ``answer`` when ``require_answer``.
    """
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: no such prompt file")
    prompts: list[Prompt] = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise PromptFileError(f"{where}: not valid UTF-8 (byte {err.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # so an error at the end of the line has its column
            except json.JSONDecodeError as err:
                raise PromptFileError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict):
                raise PromptFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if "prompt" not in record:
                raise PromptFileError(f"{where}: missing field 'prompt' (keys: {sorted(record)})")
            if not isinstance(record["prompt"], str):
                raise PromptFileError(f"{where}: field 'prompt' must be a string, "
                                      f"got {type(record['prompt']).__name__}")
            answer = record.get("answer")
            if answer is None and require_answer:
                null = ", 'answer' is null" if "answer" in record else ""
                raise PromptFileError(f"{where}: missing field 'answer' (keys: {sorted(record)}{null})")
            if answer is not None and not isinstance(answer, (str, int, float)):
                raise PromptFileError(f"{where}: field 'answer' must be a string or number, "
                                      f"got {type(answer).__name__}")
            metadata = {k: v for k, v in record.items() if k not in ("prompt", "answer")}
            prompts.append(Prompt(record["prompt"], None if answer is None else str(answer), metadata))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts (the file is empty)")
    return prompts


class JsonlTask(PromptListTask):
    """Prompts from a JSONL file, reshuffled every pass with ``seed``; an optional held-out file.

    Args:
        train_file: JSONL with ``prompt`` and ``answer`` on every line.
        heldout_file: JSONL held out for ``val/reward``; when omitted, the last ``num_heldout`` lines of a
            seeded shuffle of ``train_file`` are held out instead (and never trained on).
        num_heldout: size of the split carved from ``train_file`` when ``heldout_file`` is not given.
        seed: seeds the shuffles.
    """

    def __init__(
        self, train_file: str, heldout_file: str | None = None, num_heldout: int = 0, seed: int = 1234
    ) -> None:
        if num_heldout < 0:
            raise ValueError(f"JsonlTask: num_heldout must be >= 0, got {num_heldout}")
        prompts = read_prompt_file(train_file)
        if heldout_file is not None:
            super().__init__(prompts, read_prompt_file(heldout_file), seed)
            return
        if num_heldout >= len(prompts):
            raise ValueError(
                f"JsonlTask: num_heldout={num_heldout} leaves no training prompt in {train_file} "
                f"({len(prompts)} lines)"
            )
        order = list(range(len(prompts)))
        random.Random(seed).shuffle(order)
        cut = len(prompts) - num_heldout
        super().__init__([prompts[i] for i in order[:cut]], [prompts[i] for i in order[cut:]], seed)
