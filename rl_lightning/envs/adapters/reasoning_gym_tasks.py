"""reasoning-gym's procedural single-turn datasets as a task, scored by answer extraction + exact match
(optional: ``reasoning-gym==0.1.25``).

``ReasoningGymTask("leg_counting")`` turns a reasoning-gym dataset (``reasoning_gym.create_dataset``) into a
seeded training stream and a disjoint held-out set; its verifier is ``ReasoningGymReward``.

Why not reasoning-gym's own scoring: the default ``ProceduralDataset.score_answer(answer, entry)`` returns
``len(gold) / len(answer)`` whenever the gold string occurs anywhere inside the answer, so an output that lists
many candidates ("1 2 3 ... 292 ...") earns credit without solving anything -- a reward-hacking hole (some
datasets override it, e.g. ``chain_sum`` keeps the partial credit). ``ReasoningGymReward`` extracts one answer
and compares it exactly, after normalisation.

Tested offline with ``basic_arithmetic``, ``leg_counting``, ``chain_sum``, ``gcd``, ``lcm`` and
``spell_backward`` (any dataset whose items are generated from their index works the same way). Exact match
suits datasets with one canonical answer string; datasets whose ``score_answer`` accepts several spellings
(lists, expressions, fractions) are scored more strictly here than by reasoning-gym.
"""

from __future__ import annotations

import hashlib
import random
import re
import unicodedata
from typing import Any, Literal

from rl_lightning.envs.adapters._isolation import import_optional, preserved_global_rngs
from rl_lightning.envs.base import Prompt, RewardFunction, Task

REASONING_GYM_INSTALL = "pip install 'rl-lightning[reasoning-gym]' (see docs/environments.md)"
#: items in a row that may bring no new held-out question, or land the training stream on held-out ones, before
#: giving up (a problem space too small for ``num_heldout``)
MAX_REDRAWS = 1000


def import_reasoning_gym() -> Any:
    """The ``reasoning_gym`` module, imported without its side effect on the global ``random`` stream."""
    return import_optional("reasoning_gym", "ReasoningGymTask", REASONING_GYM_INSTALL)


def normalize_answer(text: str, ignore_case: bool = False) -> str:
    """NFKC-normalised, surrounding whitespace stripped, inner whitespace runs collapsed to one space (and
    case-folded when ``ignore_case``): ``" 12\\n  apples "`` -> ``"12 apples"``."""
    text = " ".join(unicodedata.normalize("NFKC", text).split())
    return text.casefold() if ignore_case else text


class ReasoningGymReward(RewardFunction):
    """1.0 when the extracted answer equals the reference answer after ``normalize_answer``, else 0.0.

    The answer is the content of the *last* complete ``<tag>...</tag>`` block of the response (reasoning-gym's
    own prompts ask for ``<answer>`` tags); a response without one falls back to its last non-empty line
    (``fallback="last_line"``) or scores 0 (``"none"``). Nothing else gives credit: the gold string appearing
    somewhere in the response (what reasoning-gym's default ``score_answer`` rewards) is worth 0.

    Examples (gold ``"292"``): ``"<answer>292</answer>"`` 1.0; ``"I count.\\n292"`` 1.0;
    ``"<answer>292</answer> ... <answer>291</answer>"`` 0.0 (the last block counts);
    ``"<answer>it is 292</answer>"`` 0.0; ``"290 291 292 293"`` 0.0.

    Args:
        tag: the answer tag (``None``: no tags, always the last line).
        fallback: what a response without a complete tag block is scored on.
        ignore_case: compare case-insensitively (off: e.g. ``spell_backward`` and ``word_sorting`` are
            case-sensitive).
    """

    def __init__(self, tag: str | None = "answer", fallback: Literal["last_line", "none"] = "last_line",
                 ignore_case: bool = False) -> None:
        if fallback not in ("last_line", "none"):
            raise ValueError(f"ReasoningGymReward: fallback must be 'last_line' or 'none', got {fallback!r}")
        if tag is not None and not re.fullmatch(r"[A-Za-z_][\w.-]*", tag):
            raise ValueError(f"ReasoningGymReward: tag must be a plain XML name, got {tag!r}")
        self.tag, self.fallback, self.ignore_case = tag, fallback, ignore_case
        self._block = re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL) if tag is not None else None

    def extract(self, response: str) -> str | None:
        """The answer the response gives (see the class docstring), or ``None`` when it gives none."""
        if self._block is not None:
            blocks = self._block.findall(response)
            if blocks:
                return blocks[-1]
        if self.tag is not None and self.fallback == "none":
            return None
        lines = [line for line in response.splitlines() if line.strip()]
        return lines[-1] if lines else None

    def __call__(self, prompt: Prompt, response: str) -> float:
        if prompt.answer is None:
            raise ValueError(f"ReasoningGymReward needs a reference answer; prompt {prompt.text!r} has none")
        got = self.extract(response)
        if got is None:
            return 0.0
        want = normalize_answer(str(prompt.answer), self.ignore_case)
        return 1.0 if want and normalize_answer(got, self.ignore_case) == want else 0.0


class ReasoningGymTask(Task):
    """Single-turn prompts from one reasoning-gym dataset.

    The items come from one dataset instance seeded from ``seed`` (reasoning-gym generates item ``i`` from
    ``Random(dataset_seed + i)``; the dataset seed is a hash of ``seed``, so nearby seeds do not give shifted
    copies of one stream). The held-out set is the first ``num_heldout`` distinct questions of items
    ``0, 1, 2, ...``; the training stream draws items at random indices above those, seeded by ``seed`` and the
    stream index, and skips any whose question is held out. A prompt's text is the question (plus
    ``instruction`` on a new line), its answer reasoning-gym's gold answer, its metadata the dataset name, item
    index and reasoning-gym's item metadata.

    Args:
        dataset: a reasoning-gym dataset name, e.g. ``"basic_arithmetic"``, ``"leg_counting"``, ``"chain_sum"``.
        config: the dataset's configuration fields (``reasoning_gym.create_dataset(dataset, **config)``; not
            ``seed``/``size``, which the task sets).
        num_heldout: size of the held-out set.
        seed: seeds both the held-out split and the training stream.
        instruction: appended to each question on a new line (e.g. "Give your final answer in
            <answer></answer> tags."); ``None``: the question alone.
    """

    def __init__(self, dataset: str = "basic_arithmetic", config: dict[str, Any] | None = None, num_heldout: int = 200,
                 seed: int = 1234, instruction: str | None = None) -> None:
        rg = import_reasoning_gym()
        if num_heldout < 0:
            raise ValueError(f"ReasoningGymTask: num_heldout must be >= 0, got {num_heldout}")
        config = dict(config or {})
        for key in ("seed", "size"):
            if key in config:
                raise ValueError(f"ReasoningGymTask: config may not set {key!r} (the task sets it; use `seed`)")
        if dataset not in rg.factory.DATASETS:
            raise ValueError(f"ReasoningGymTask: no reasoning-gym dataset {dataset!r} "
                             f"(e.g. {', '.join(sorted(rg.factory.DATASETS)[:8])}, ...)")
        self.dataset, self.config, self.num_heldout, self.seed = dataset, config, num_heldout, seed
        self.instruction = instruction
        digest = hashlib.blake2b(f"rl_lightning:{dataset}:{seed}".encode(), digest_size=4).digest()
        self.dataset_seed = int.from_bytes(digest, "little")
        with preserved_global_rngs():
            self._data = rg.create_dataset(dataset, seed=self.dataset_seed, size=2**62, **config)
        self._heldout: list[Prompt] = []
        self._heldout_questions: set[str] = set()
        index = since_new = 0
        while len(self._heldout) < num_heldout:
            if since_new >= MAX_REDRAWS:
                raise ValueError(f"ReasoningGymTask: {dataset} gave only {len(self._heldout)} distinct questions in "
                                 f"{index} items; lower num_heldout={num_heldout} or widen its config")
            prompt = self._prompt(index)
            since_new += 1
            if prompt.metadata["question"] not in self._heldout_questions:
                self._heldout_questions.add(prompt.metadata["question"])
                self._heldout.append(prompt)
                since_new = 0
            index += 1
        self._first_train_index = index

    def _prompt(self, index: int) -> Prompt:
        with preserved_global_rngs():  # reasoning-gym seeds its own Random per item; this is insurance
            item = self._data[index]
        question = str(item["question"])
        text = question if self.instruction is None else f"{question}\n{self.instruction}"
        return Prompt(text=text, answer=str(item["answer"]), metadata={
            "dataset": self.dataset, "index": index, "question": question, "rg_metadata": item.get("metadata", {})})

    def train_prompt(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + 7919 * index + 1)
        for _ in range(MAX_REDRAWS):
            prompt = self._prompt(self._first_train_index + rng.randrange(2**48))
            if prompt.metadata["question"] not in self._heldout_questions:
                return prompt
        raise ValueError(f"ReasoningGymTask: {MAX_REDRAWS} draws of {self.dataset} all landed on held-out "
                         f"questions; lower num_heldout={self.num_heldout} or widen its config")

    def heldout_prompts(self) -> list[Prompt]:
        return list(self._heldout)

    def default_reward(self) -> RewardFunction:
        return ReasoningGymReward()
