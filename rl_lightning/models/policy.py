"""Build the policy: the embedded tiny default, or any local Hugging Face causal-LM checkpoint.

``model_name_or_path`` accepts:

* ``"embedded:arithmetic"`` -- the warm-started tiny Llama shipped inside this package
  (``models/assets/arithmetic``, produced by ``experiments/warm_start.py``);
* ``"embedded:<name>"`` -- any other asset directory ``models/assets/<name>``, e.g. ``"embedded:arithmetic_hard"``
  (the same architecture warm-started on 3-digit addition, for ``configs/tasks/arithmetic_hard.yaml``);
* ``"embedded:random"`` -- the same architecture with fresh random weights (for tests and benchmarks);
* a local directory holding a Hugging Face checkpoint (``config.json`` + weights + tokenizer files).

Nothing is ever downloaded: loading uses ``local_files_only=True``. Every tokenizer is checked at load: it must
encode text to tokens and have an EOS token (a directory without tokenizer files is refused: Hugging Face would
otherwise build an empty tokenizer for some architectures, which encodes every prompt to ``[]``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_info
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers import PreTrainedTokenizerBase

from rl_lightning.models.attention import use_grouped_attention
from rl_lightning.models.recompute import recompute_activations
from rl_lightning.models.tokenizer import build_char_tokenizer

ASSETS = Path(__file__).parent / "assets"
EMBEDDED_PREFIX = "embedded:"
DType = Literal["float32", "bfloat16", "float16"]
#: files that hold a tokenizer's vocabulary (``tokenizer_config.json`` alone holds none); globs allowed
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "*.model", "*.tiktoken")
#: encoded by every tokenizer at load: a usable one turns it into at least one token
TOKENIZER_SAMPLE_TEXT = "Hello 1+1="


def tiny_llama_config(
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 64,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> LlamaConfig:
    """The embedded default's architecture: a 1.1M-parameter Llama (hidden 128, 4 layers, 4 heads, ffn 512).

    Special ids are set explicitly (a config's defaults may point outside a small vocabulary).
    """
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )


def build_tiny_policy(seed: int = 0, **config_overrides: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A freshly initialised tiny Llama and the character tokenizer (deterministic for a given ``seed``)."""
    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **config_overrides,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


#: local checkpoints that a script of this repository builds (their directory name -> the command)
BUILT_BY = {"SmolLM2-135M-Instruct": "python experiments/smollm2.py"}


def missing_model_hint(model_name_or_path: str, path: Path) -> str:
    """What to do about a checkpoint directory that does not exist: a Hub id (``owner/name``) is downloaded by the
    user, never by rl_lightning; a checkpoint a script of this repository builds names the script."""
    built_by = BUILT_BY.get(path.name)
    looks_like_hub_id = (model_name_or_path.count("/") == 1 and not model_name_or_path.startswith((".", "/", "~"))
                         and not path.parent.is_dir())
    if looks_like_hub_id:
        also = f" (this one is also built offline by `{built_by}`)" if built_by else ""
        return (f"if it is a Hugging Face Hub id, download it yourself (e.g. `hf download {model_name_or_path} "
                f"--local-dir <dir>`) and pass the local directory: rl_lightning never downloads{also}")
    return f"build it with `{built_by}`" if built_by else "give the local directory of a Hugging Face checkpoint"


def resolve_model_path(model_name_or_path: str) -> Path | None:
    """Map ``embedded:<name>`` to the packaged asset directory; ``embedded:random`` maps to ``None``."""
    if not model_name_or_path.startswith(EMBEDDED_PREFIX):
        return Path(os.path.expanduser(model_name_or_path))
    name = model_name_or_path[len(EMBEDDED_PREFIX):]
    if name == "random":
        return None
    path = ASSETS / name
    if not path.is_dir():
        available = sorted(p.name for p in ASSETS.iterdir() if p.is_dir()) if ASSETS.is_dir() else []
        raise FileNotFoundError(
            f"model_name_or_path={model_name_or_path!r}: no embedded model named {name!r} "
            f"(available: {', '.join(['random', *available])}). The arithmetic warm start is built by "
            f"`python experiments/warm_start.py`."
        )
    return path


def check_tokenizer_files(model_name_or_path: str, path: Path) -> None:
    """Refuse a checkpoint directory without a tokenizer vocabulary (one ``FileNotFoundError`` line naming it)."""
    if any(next(path.glob(pattern), None) is not None for pattern in TOKENIZER_VOCAB_FILES):
        return
    config = "tokenizer_config.json holds no vocabulary; " if (path / "tokenizer_config.json").is_file() else ""
    raise FileNotFoundError(
        f"model_name_or_path={model_name_or_path!r}: no tokenizer in {path}: {config}missing tokenizer.json "
        f"and any vocabulary file ({', '.join(TOKENIZER_VOCAB_FILES[1:])}); save the tokenizer next to the "
        f"weights (tokenizer.save_pretrained)"
    )


def check_tokenizer(model_name_or_path: str, tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse a tokenizer that encodes a sample text to no tokens or has no EOS token (one ``ValueError`` line)."""
    where = (f"model_name_or_path={model_name_or_path!r}: the tokenizer ({type(tokenizer).__name__}, "
             f"{len(tokenizer)} tokens)")
    if not tokenizer(TOKENIZER_SAMPLE_TEXT, add_special_tokens=False)["input_ids"]:
        raise ValueError(f"{where} encodes {TOKENIZER_SAMPLE_TEXT!r} to no tokens: its vocabulary is empty or broken")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{where} has no EOS token, so responses could never end: set eos_token in its "
                         f"tokenizer_config.json")


def ensure_pad_token(model_name_or_path: str, tokenizer: PreTrainedTokenizerBase) -> None:
    """Pad with EOS when the tokenizer has no pad token (padding is masked out, so any id will do), and say so."""
    if tokenizer.pad_token_id is not None:
        return
    tokenizer.pad_token = tokenizer.eos_token
    rank_zero_info(f"model_name_or_path={model_name_or_path!r}: the tokenizer has no pad token; padding with "
                   f"EOS ({tokenizer.eos_token!r}, id {tokenizer.eos_token_id})")


def load_policy(
    model_name_or_path: str, dtype: DType = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, offline, check the tokenizer, and make sure a pad token exists.

    A checkpoint that loads with Hugging Face's ``sdpa`` attention runs ``sdpa_gqa`` (``models.attention``: grouped
    key/value heads are not copied per query head on the CPU; the same outputs, gradients equal up to float32
    summation order). Every model's gated MLPs and RMS norms rebuild their elementwise products in the backward
    instead of keeping them (``models.recompute``: the same outputs and gradients, bit for bit).

    Raises:
        FileNotFoundError: one line naming ``model_name_or_path`` when the directory is missing or holds no
            loadable model or no tokenizer files.
        ValueError: one line naming ``model_name_or_path`` when the tokenizer encodes a sample text to no
            tokens or has no EOS token.
    """
    torch_dtype = getattr(torch, dtype)
    path = resolve_model_path(model_name_or_path)
    if path is None:
        model, tokenizer = build_tiny_policy()
        check_tokenizer(model_name_or_path, tokenizer)
        model = model.to(torch_dtype)
        recompute_activations(model)
        return model, tokenizer
    if not path.is_dir():
        raise FileNotFoundError(f"model_name_or_path={model_name_or_path!r}: no such directory; "
                                f"{missing_model_hint(model_name_or_path, path)}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model_name_or_path={model_name_or_path!r}: not a Hugging Face checkpoint directory "
            f"(no config.json in {path})"
        )
    check_tokenizer_files(model_name_or_path, path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch_dtype)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(
            f"model_name_or_path={model_name_or_path!r}: could not load a causal LM from {path}: {first_line}"
        ) from None
    check_tokenizer(model_name_or_path, tokenizer)
    ensure_pad_token(model_name_or_path, tokenizer)
    tokenizer.padding_side = "left"
    use_grouped_attention(model)
    recompute_activations(model)
    return model, tokenizer
