"""Shared helpers for the rollout tests (imported as a plain module; pytest puts this folder on sys.path)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rl_lightning.models.tokenizer import CHARACTERS, SPECIAL_TOKENS
from rl_lightning.rollout import RolloutBatch
from rl_lightning.rollout.generation import Generation


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token lists into ``(input_ids, attention_mask)``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def encode(tokenizer, texts: list[str], add_bos: bool = True) -> tuple[Tensor, Tensor]:
    rows = [
        ([tokenizer.bos_token_id] if add_bos else []) + tokenizer(t, add_special_tokens=False)["input_ids"]
        for t in texts
    ]
    return left_pad(rows, tokenizer.pad_token_id)


def batch_like_datamodule(prompt_ids: Tensor, prompt_mask: Tensor, gen: Generation, group_size: int,
                          temperature: float, top_p: float) -> RolloutBatch:
    """The ``RolloutBatch`` that ``RolloutDataModule.rollout`` builds from a generation (zero rewards)."""
    n = prompt_ids.shape[0]
    return RolloutBatch.from_generation(prompt_ids, prompt_mask, gen, rewards=torch.zeros(n), group_size=group_size,
                                        prompt_index=torch.arange(n) // group_size, temperature=temperature,
                                        top_p=top_p)


class ScriptedLM(nn.Module):
    """A fake causal LM that, at generation step ``s``, puts (almost) all mass on ``script[row, s]``.

    The KV "cache" is just the step counter. Every call's ``attention_mask`` is recorded in ``calls``.
    """

    def __init__(self, script: list[list[int]], vocab_size: int) -> None:
        super().__init__()
        self.script = torch.tensor(script, dtype=torch.long)
        self.vocab_size = vocab_size
        self.anchor = nn.Parameter(torch.zeros(1))  # so next(parameters()) gives a device
        self.calls: list[Tensor] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, logits_to_keep=0,
                past_key_values=None, **kwargs):
        step = 0 if past_key_values is None else past_key_values
        self.calls.append(attention_mask.clone())
        n, length = input_ids.shape
        logits = torch.full((n, length, self.vocab_size), -1e4)
        target = self.script[:n, min(step, self.script.shape[1] - 1)]
        logits[torch.arange(n), -1, target] = 0.0
        return SimpleNamespace(logits=logits, past_key_values=step + 1)


def char_tokenizer_specials_last() -> PreTrainedTokenizerFast:
    """The embedded character tokenizer with the special tokens at the *end* of the vocabulary.

    Id 0 is then the ordinary character ``"0"`` and ``<pad>`` is not 0 -- as in most real tokenizers (id 0 is
    ``"!"`` for GPT-2, Llama 3 and Qwen; their pad/eos ids are large).
    """
    vocab = {ch: i for i, ch in enumerate(CHARACTERS)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left", clean_up_tokenization_spaces=False,
    )


def fake_trainer(module, global_rank: int = 0, world_size: int = 1) -> SimpleNamespace:
    """What ``RolloutDataModule`` reads from its trainer."""
    return SimpleNamespace(lightning_module=module, global_rank=global_rank, world_size=world_size)
