"""Shared helpers for the rollout tests (imported as a plain module; pytest puts this folder on sys.path)."""

from __future__ import annotations

import math
import time
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


#: unit roundoff of float32: every rounded operation has relative error at most u = eps / 2 = 2^-24
FP32_UNIT_ROUNDOFF = torch.finfo(torch.float32).eps / 2


def fp32_logprob_tolerance(logit_scale: float, temperature: float, vocab_size: int, num_layers: int,
                           hidden_size: int, intermediate_size: int, head_dim: int, context_length: int) -> float:
    """How far two float32 computations of the same sampling log-prob may differ by rounding alone.

    The sampler scores token ``t`` from logits ``z`` of an incremental KV-cache decode, the learner from one full
    forward: the same arithmetic through different kernels and reduction orders (which also differ between
    CPUs: AVX2 and AVX-512 kernels split a dot product into different partial sums). Nothing here is fitted to
    a machine; it is a first-order rounding estimate from the quantities below, ``u = 2^-24`` the float32 unit
    roundoff and ``S`` (``logit_scale``) the largest ``Σ_i |W_vi h_i|`` of the LM head ``z_v = Σ_i W_vi h_i``
    over the scored positions and the vocabulary (so ``max|z| <= S``).

    1. Logits. A float32 sum of ``n`` terms carries a rounding error of about ``sqrt(n) · u · Σ|terms|`` (the
       probabilistic bound of Higham & Mary, 2019; the worst case ``n · u`` assumes every rounding has the same
       sign). The relative errors of the reductions in series before the head add in quadrature, so the final
       hidden state carries a relative error of about ``sqrt(K) · u`` per element, which the head turns into
       ``|Δz_v| <= sqrt(K) · u · Σ_i |W_vi h_i| <= sqrt(K) · u · S`` (its own sum of ``hidden_size`` terms is
       counted in ``K``). ``K`` is the accumulated reduction length along the forward: per layer the two RMS
       norms, the q/k/v projections, the o projection and the gate/up projections (``hidden_size`` each:
       ``4 · hidden_size`` in series), the down projection (``intermediate_size``), the attention scores
       (``head_dim``) and the softmax sum and weighted sum over the context (``2 · context_length``); then the
       final norm and the head (``2 · hidden_size``). The two paths round independently:
       ``|Δz| <= 2 · sqrt(K) · u · S``.
    2. Temperature. ``log p_t = z_t / T - logsumexp(z / T)`` and ``|Δ logsumexp(z / T)| <= max|Δz| / T``, so
       ``|Δ log p| <= 2 · max|Δz| / T``: a low temperature amplifies logit errors by ``1 / T``. (Top-p adds no
       rounding term: it only masks logits, and the sampled token stays in the support.)
    3. The log-softmax itself, in each path (``s = z / T``, ``m = max s``, ``ℓ = s - m - log Σ exp(s - m)``):
       the division (``u · S / T``), ``s - m`` (``u · 2 S / T``), the exponentials and their sum of ``V``
       terms (``(1 + sqrt(V)) · u`` relative, the same absolute after the log), the log (``u · log V``) and
       the last subtraction (``u · |ℓ| <= u · (2 S / T + log V)``):
       ``2 · u · (5 · S / T + sqrt(V) + 2 · log V + 1)`` for the two paths.

    It does not cover a top-p nucleus whose boundary token flips between the paths (that changes the log-prob
    by the token's probability mass), nor low-precision dtypes (``u`` is float32's).

    Args:
        logit_scale: ``S = max Σ_i |W_vi h_i|`` (``model_logprob_tolerance`` computes it).
        temperature: the sampler's temperature ``T``.
        vocab_size: ``V``.
        num_layers, hidden_size, intermediate_size, head_dim: the decoder's shape.
        context_length: the longest sequence attended over (prompt plus response).
    """
    u = FP32_UNIT_ROUNDOFF
    depth = num_layers * (4 * hidden_size + intermediate_size + head_dim + 2 * context_length) + 2 * hidden_size
    logit_diff = 2 * math.sqrt(depth) * u * logit_scale
    log_softmax_rounding = 2 * u * (5 * logit_scale / temperature + math.sqrt(vocab_size)
                                    + 2 * math.log(vocab_size) + 1)
    return 2 * logit_diff / temperature + log_softmax_rounding


def model_logprob_tolerance(model: nn.Module, hidden: Tensor, temperature: float, context_length: int) -> float:
    """``fp32_logprob_tolerance`` for a Hugging Face decoder: its config, and ``S`` from its LM head's weight and
    the final (normed) hidden states ``hidden [..., H]`` of the scored positions."""
    cfg = model.config
    head = model.get_output_embeddings().weight.detach().float()
    scale = float((hidden.detach().float().abs() @ head.abs().T).max())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return fp32_logprob_tolerance(scale, temperature, cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size,
                                  cfg.intermediate_size, head_dim, context_length)


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


class VersionedTrainer:
    """``fake_trainer`` whose ``global_step`` (the learner's version) the test sets through ``version[0]``."""

    def __init__(self, base, version: list[int]) -> None:
        self.__dict__.update(vars(base))
        self.state = SimpleNamespace(fn="fit")  # a fit is running: checkpoints save the updates done
        self._version = version

    @property
    def global_step(self) -> int:
        return self._version[0]


def wait_full(dm) -> None:
    """Block until the asynchronous producer of ``dm`` has filled its queue."""
    for _ in range(600):
        if len(dm._producer.items) >= dm.async_rollout.queue:
            return
        time.sleep(0.05)
    raise AssertionError("the producer did not fill its queue")
