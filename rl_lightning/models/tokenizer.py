"""A character-level tokenizer for the embedded default, as a real ``PreTrainedTokenizerFast``.

Every printable ASCII character is one token, plus ``<pad>``, ``<bos>``, ``<eos>`` and ``<unk>``. It saves
and loads with ``save_pretrained``/``from_pretrained`` like any Hugging Face tokenizer, so the embedded
default and a user's local checkpoint travel the same code path.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = tuple(string.digits + string.punctuation + " " + string.ascii_letters)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer: ids 0..3 are pad/bos/eos/unk, then one id per printable character.

    Example:
        >>> tok = build_char_tokenizer()
        >>> tok("37+48=")["input_ids"]
        [7, 11, 24, 8, 12, 32]
        >>> tok.decode([12, 9])
        '85'
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split into single characters, keeping every one of them (spaces included) as its own token.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
