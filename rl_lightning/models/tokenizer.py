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


NUMBER_SYMBOLS = ("+", "=", ";", "#")
MAX_NUMBER_TOKEN = 999


def build_number_tokenizer(max_number: int = MAX_NUMBER_TOKEN) -> PreTrainedTokenizerFast:
    """Build a word-level tokenizer in which every number ``0..max_number`` is one token.

    Ids 0..3 are ``<pad>``/``<bos>``/``<eos>``/``<unk>`` (as in ``build_char_tokenizer``), then ``+ = ; #`` (ids
    4..7), then the numbers ``0..max_number`` (number ``k`` is id ``8 + k``): 1,008 tokens with the default 999.
    Text is split into runs of digits and single other characters (whitespace dropped); a run of digits that is
    not a number of the vocabulary in its plain form (``1000``, ``007``) and any other character are ``<unk>``.
    Decoding joins the tokens without spaces, so ``decode(encode(s)) == s`` for every text made of the vocabulary.
    It is what ``embedded:running_sum`` uses (``RunningSumTask``), saved and loaded like any Hugging Face tokenizer.

    Example:
        >>> tok = build_number_tokenizer()
        >>> tok("12+35=")["input_ids"]
        [20, 4, 43, 5]
        >>> tok.decode([20, 4, 43, 5, 55])
        '12+35=47'
    """
    if max_number < 9:
        raise ValueError(f"build_number_tokenizer: max_number must be >= 9, got {max_number}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in NUMBER_SYMBOLS:
        vocab[symbol] = len(vocab)
    for number in range(max_number + 1):
        vocab[str(number)] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(r"[0-9]+|[^0-9]"), behavior="isolated"),
    ])
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
