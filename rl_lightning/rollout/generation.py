"""Sampling with a KV cache, recording the sampler's per-token log-probs under its exact distribution.

One prompt forward fills the cache; each further step feeds one token per running row. Rows stop at EOS
(later positions are padding with ``loss_mask = 0``); finished rows leave the forward batch (the cache is cut
to the running rows) once enough of them have stopped, and the loop ends when every row has stopped.

Identical prompt rows (the ``G`` rows of a group) are prefilled once (``share_prefill``): the forward runs on the
distinct prompts and its cache and last logits are repeated to every row that has that prompt (``distinct_rows``,
``expandable_cache``), so the decode that follows, and its random stream, are those of a full prefill.
"""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from rl_lightning.functional.logprobs import sampling_logits
from rl_lightning.models.sharding import is_sharded
from rl_lightning.rollout.static_decode import StaticDecoder, supports


try:  # recent transformers: a cache is a list of layers; a plain DynamicLayer holds [B, kv, S, D] keys/values
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - older transformers
    from transformers.cache_utils import DynamicCache
    DynamicLayer = None


@dataclass
class Generation:
    """Output of ``sample``: ``[N, T]`` tensors, with ``T <= max_new_tokens``."""

    response_ids: Tensor  # generated ids, pad after EOS
    logprobs: Tensor  # sampler log-prob of each generated token (0 on padding)
    mask: Tensor  # 1 on generated tokens (EOS included)
    truncated: Tensor  # [N] bool: no EOS within max_new_tokens
    topk_ids: Tensor | None = None  # [N, T, k] the sampling distribution's k most likely ids (on request)
    topk_logprobs: Tensor | None = None  # [N, T, k] their log-probs, normalised over the full vocabulary
    aux_ids: Tensor | None = None  # [N, T, K] K extra draws from the sampling distribution (on request)

    @property
    def finish_reasons(self) -> list[str]:
        """Why each row ended: ``"stop"`` (its EOS) or ``"length"`` (``max_new_tokens`` without one)."""
        return ["length" if cut else "stop" for cut in self.truncated.tolist()]

    @classmethod
    def from_lists(cls, ids: list[list[int]], logprobs: list[list[float]], finish_reasons: list[str],
                   pad_token_id: int, device: torch.device | str = "cpu") -> Generation:
        """The ``[N, T]`` layout of per-row sampled ids and log-probs (an external engine's output; EOS included
        in a row that stopped), right-padded with ``pad_token_id``."""
        width = max(1, max(len(row) for row in ids))
        response = torch.full((len(ids), width), pad_token_id, dtype=torch.long)
        logps = torch.zeros((len(ids), width))
        for i, (row, lps) in enumerate(zip(ids, logprobs)):
            response[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            logps[i, :len(row)] = torch.tensor(lps, dtype=torch.float32)
        mask = (torch.arange(width) < torch.tensor([len(row) for row in ids]).unsqueeze(1)).long()
        truncated = torch.tensor([reason == "length" for reason in finish_reasons])
        return cls(response.to(device), logps.to(device), mask.to(device), truncated.to(device))


def sampler_extras(logp_all: Tensor, topk: int, aux_draws: int, aux_generator: torch.Generator | None
                   ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Per position (``logp_all``: ``[N, V]`` log-probs of the sampling distribution): the top-``topk`` ids and
    their full-vocabulary log-probs, and ``aux_draws`` draws from it with ``aux_generator`` -- a generator of its
    own, so the sampled tokens are the same with or without them (Score Centering, StableReinforce)."""
    ids = lps = aux = None
    if topk > 0:
        lps, ids = logp_all.topk(min(topk, logp_all.shape[-1]), dim=-1)
    if aux_draws > 0:
        aux = torch.multinomial(logp_all.exp(), aux_draws, replacement=True, generator=aux_generator)
    return ids, lps, aux


#: drop finished rows from the forward batch once the running ones are at most this fraction of it
DEFAULT_COMPACT_BELOW = 0.75


def check_compact_below(value: float, owner: str = "sample") -> float:
    """``value`` if it is a valid ``compact_below`` (a fraction in [0, 1]); else a ``ValueError`` naming ``owner``."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner}: compact_below must be in [0, 1], got {value}")
    return value


def cache_argument(model: nn.Module) -> str:
    """The forward keyword of the KV cache: ``cache`` (transformers >= 5.2x) or ``past_key_values`` (older)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out: object) -> object:
    """The KV cache a forward returned (``out.cache`` or the older ``out.past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


#: ``categorical_draw`` leaves smaller vocabularies to ``torch.multinomial`` (the same index; faster there)
DRAW_MIN_VOCAB = 1024
#: relative slack of ``categorical_draw``'s estimate of every ratio (its error is a few float32 ulps, under 1e-6)
DRAW_MARGIN = 1e-5
#: entries per ``categorical_draw`` chunk (about 1 MB of double temporaries)
DRAW_CHUNK = 1 << 17


def categorical_draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index per row of ``probs`` ``[N, V]``: the index ``torch.multinomial(probs, 1, generator=generator)``
    draws on a CPU, with the generator left in the same state, at a fraction of its cost on a large vocabulary.

    ``torch.multinomial`` draws one sample as ``argmax(p / q)`` with ``q ~ Exp(1)`` per entry (the exponential race),
    each ``q`` made one at a time as ``-log1p(-u)`` in double precision (``u`` a 53-bit uniform) and cast to float32:
    at a 49k vocabulary that serial loop is most of a decode step's sampling time. Here the same uniforms come from
    one ``torch.rand(float64)`` (it consumes the generator as ``exponential_`` does); a vectorised estimate
    ``-log(1 - u)`` (``1 - u`` is exact for a 53-bit ``u``; double ``log`` is accurate to an ulp of its result, so
    the float32 ratio is within a few ulps of torch's) finds the entries within ``DRAW_MARGIN`` of each row's largest
    ratio; only those get ``q`` exactly as torch makes it, and the argmax of their exact ratios is torch's index. (One
    case is not reproduced: ``u = 0`` exactly, probability ``2^-53`` an entry, on an entry of probability 0.) Any
    other device, ``probs`` that is not a float32 matrix, and a vocabulary under ``DRAW_MIN_VOCAB`` entries (where
    the fixed costs here outweigh the serial loop: ``experiments/bench_draw.py``) go to ``torch.multinomial`` itself.

    Raises:
        RuntimeError: ``probs`` holds a negative, infinite or NaN entry (as ``torch.multinomial`` does).
    """
    if (probs.device.type != "cpu" or probs.dtype != torch.float32 or probs.dim() != 2
            or probs.shape[1] < DRAW_MIN_VOCAB):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if not bool(torch.isfinite(probs.sum()) and probs.min() >= 0):
        raise RuntimeError("categorical_draw: probability tensor contains either inf, nan or element < 0")
    step = max(1, DRAW_CHUNK // probs.shape[1])  # rows at a time: the double temporaries stay in cache
    return torch.cat([_race(probs[start:start + step], generator) for start in range(0, probs.shape[0], step)])


def _race(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """``categorical_draw`` on a few rows (the uniforms are drawn in row order, so chunks consume the generator as
    one draw over every row would)."""
    u = torch.rand(probs.shape, dtype=torch.float64, generator=generator)
    estimate = probs / torch.log(1 - u).neg_().float()
    rows, cols = (estimate >= estimate.amax(dim=-1, keepdim=True) * (1 - DRAW_MARGIN)).nonzero(as_tuple=True)
    exact = torch.tensor([-math.log1p(-x) for x in u[rows, cols].tolist()], dtype=torch.float64).float()
    ratios = torch.full_like(probs, float("-inf")).index_put_((rows, cols), probs[rows, cols] / exact)
    return ratios.argmax(dim=-1)


def draw(logits: Tensor, temperature: float, top_p: float, greedy: bool, generator: torch.Generator | None
         ) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row of next-token ``logits`` ``[N, V]``: ``(token [N], its log-prob [N], the sampling
    distribution's log-probs [N, V])``, drawn from ``softmax(top_p(logits / temperature))`` with ``generator``
    (``greedy``: the argmax of the raw logits; the log-probs stay the tempered distribution's)."""
    scaled = sampling_logits(logits, temperature, top_p)  # [N, V]
    logp_all = torch.log_softmax(scaled, dim=-1)
    if greedy:
        token = logits.argmax(dim=-1)
    else:  # softmax, not exp(log_softmax), and multinomial's draw: Hugging Face's sampler for the same RNG state
        token = categorical_draw(torch.softmax(scaled, dim=-1), generator)
    return token, logp_all.gather(-1, token.unsqueeze(-1)).squeeze(-1), logp_all


def expandable_cache(cache: object) -> bool:
    """Whether ``cache`` is a plain ``DynamicCache`` (every layer the whole history, no sliding window, no
    quantisation or offloading), whose rows ``batch_select_indices`` may repeat: the repeated rows then hold exactly
    what a forward of the repeated inputs would have put there (indexing is differentiable, too)."""
    if type(cache) is not DynamicCache or not callable(getattr(cache, "batch_select_indices", None)):
        return False
    layers = getattr(cache, "layers", None)
    return layers is None or (DynamicLayer is not None and all(type(layer) is DynamicLayer for layer in layers))


def repeat_cache_rows(cache: DynamicCache, index: Tensor) -> None:
    """Replace every layer's keys and values of ``cache`` (an ``expandable_cache``) by their rows ``index``, in place
    of the cache's own ``batch_select_indices``, differentiably and deterministically.

    ``batch_select_indices`` indexes (``keys[index]``), whose backward is an accumulating ``index_put_``; on CPU with
    several threads that adds a repeated row's gradients with atomics, in an order that depends on thread timing,
    so two identical runs differ in the last bits. ``index_select``'s backward (``index_add_``) adds the rows in
    index order: the same values forward, and a gradient that is the same on every run.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:  # a cache without per-layer objects: its own indexing (the same values)
        cache.batch_select_indices(index)
        return
    for layer in layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)


#: models whose forward returned a KV cache that cannot be shared between rows (said once, then not tried again)
_UNSHAREABLE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def unshareable(model: nn.Module, cache: object) -> None:
    """Remember that ``model``'s ``cache`` cannot be shared between rows, and say so once."""
    if model not in _UNSHAREABLE:
        _UNSHAREABLE.add(model)
        rank_zero_info(f"shared prompt forward: {type(model).__name__} returns a {type(cache).__name__} cache, which "
                       f"cannot be shared between rows; its prompts are forwarded once per row")


def stochastic_forward(model: nn.Module) -> bool:
    """Whether ``model``'s forward may differ between two identical rows: dropout active in training mode (a
    ``Dropout`` module with ``p > 0``, or a config ``attention_dropout > 0`` as Llama's functional dropout)."""
    if not model.training:
        return False
    if float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def can_share_prompts(model: nn.Module) -> bool:
    """Whether identical prompt rows may share one forward of ``model`` (``prefill``,
    ``algorithms.forward.shared_prompt_forward``): a Hugging Face model (it has a ``config``) whose cache has not
    been found unshareable, whose forward is deterministic (``stochastic_forward``), keeps a cache (no gradient
    checkpointing) and is not sharded by FSDP2 (each forward is a collective there, and whether a micro-batch
    shares depends on its rows, which differ per rank: the ranks would run different numbers of forwards)."""
    if (getattr(model, "config", None) is None or model in _UNSHAREABLE or stochastic_forward(model)
            or is_sharded(model)):
        return False
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return not getattr(model, name, False)


def distinct_rows(key: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(first, inverse)`` for the rows of ``key`` ``[N, K]`` when some are equal, else ``None``.

    ``first`` ``[U]`` is the first row of each distinct value, in order of appearance, and ``inverse`` ``[N]`` the
    index into ``first`` of every row: ``key[first][inverse] == key``. For ``U`` groups of ``G`` contiguous equal
    rows, ``first = [0, G, 2G, ...]`` and ``inverse = arange(N) // G``.
    """
    n = key.shape[0]
    if n < 2:
        return None
    values, inverse = torch.unique(key, dim=0, return_inverse=True)
    count = values.shape[0]
    if count == n:
        return None
    rows = torch.arange(n, device=key.device)
    first = torch.full((count,), n, dtype=torch.long, device=key.device).scatter_reduce(0, inverse, rows, "amin")
    order = torch.argsort(first)  # distinct values in order of first appearance
    rank = torch.empty_like(order)
    rank[order] = torch.arange(count, device=key.device)
    return first[order], rank[inverse]


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1``, clamped at 0 on the padding itself."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def prefill(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, positions: Tensor, share: bool = True
            ) -> tuple[object, Tensor]:
    """``(cache, next-token logits [N, V])`` of one prompt forward over a left-padded batch.

    With ``share``, when some rows are identical (ids and mask: the ``G`` rows of a group), the forward runs on the
    distinct rows only and its cache (``expandable_cache``) and logits are repeated to every row; a model that
    cannot share (``can_share_prompts``) or whose cache cannot be repeated exactly gets the forward of every row.
    """
    shared = distinct_rows(torch.cat([input_ids, attention_mask], dim=1)) \
        if share and can_share_prompts(model) else None
    if shared is not None:
        first, inverse = shared
        out = model(input_ids=input_ids[first], attention_mask=attention_mask[first], position_ids=positions[first],
                    use_cache=True, logits_to_keep=1)
        cache = returned_cache(out)
        if expandable_cache(cache):
            cache.batch_select_indices(inverse)
            return cache, out.logits[:, -1][inverse]
        unshareable(model, cache)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    return returned_cache(out), out.logits[:, -1]


#: records the sampling distribution's top-k ids and their log-probs per sampled position
TOPK = "topk"
#: records independent auxiliary draws from the sampling distribution per sampled position
AUX_DRAWS = "aux_draws"


@dataclass(frozen=True)
class SamplingParams:
    """The explicit settings of one ``generate`` call or session.

    Attributes:
        max_tokens: new tokens per row (per turn in a session).
        eos_token_id: ends a row (the EOS is one of its tokens); ``pad_token_id`` fills the positions after it.
        temperature, top_p: tokens are drawn from ``softmax(top_p(logits / temperature))`` and the log-probs
            returned are that distribution's (``functional.sampling_logprobs``).
        greedy: take the argmax of the raw logits (held-out rollouts); the log-probs stay the tempered ones.
        seed: seeds the draws (the same seed gives the same tokens); ``None``: torch's global RNG.
        topk: also return, per sampled position, the sampling distribution's ``topk`` most likely ids and their
            log-probs over the full vocabulary (needs ``TOPK``).
        aux_draws: also return ``aux_draws`` draws per position from the sampling distribution, seeded by
            ``aux_seed`` alone, so the sampled tokens are the same with or without them (needs ``AUX_DRAWS``).
    """

    max_tokens: int
    eos_token_id: int
    pad_token_id: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    seed: int | None = None
    topk: int = 0
    aux_draws: int = 0
    aux_seed: int | None = None

    def needs(self) -> dict[str, str]:
        """The capabilities these settings need, each with the setting that asks for it."""
        needs = {TOPK: f"topk={self.topk}"} if self.topk else {}
        return needs | ({AUX_DRAWS: f"aux_draws={self.aux_draws}"} if self.aux_draws else {})


@dataclass(frozen=True)
class DecodeOptions:
    """How ``sample`` runs the decode; the tokens drawn are the same with every setting (``KVCacheEngine``'s).

    Attributes:
        drop_finished: with a cache that supports ``batch_select_indices`` (Hugging Face's do), rows that have
            emitted EOS leave the forward batch once the still-running rows are at most ``compact_below`` of it:
            the cache is cut to the running rows, so long-tailed response lengths stop costing a forward for every
            finished row. The draw is still made for all rows (finished rows get a dummy distribution), so the
            random stream, and with it every token, is the same as without dropping.
        compact_below: a fraction in [0, 1] (1.0: cut at every EOS; lower values copy the cache less often).
        static_cache: a model that ``static_decode.supports`` (Llama / Qwen2 / Mistral decoders) decodes on
            ``StaticDecoder``: the same arithmetic on a pre-allocated KV cache without Hugging Face's per-step
            machinery. Other models, and ``False``, use the model's own forward.
        share_prefill: rows with identical prompts (ids and mask) are prefilled once (``prefill``); the decode, and
            every draw, is the same as after a prefill of every row (the logits agree to float rounding).
    """

    drop_finished: bool = True
    compact_below: float = DEFAULT_COMPACT_BELOW
    static_cache: bool = True
    share_prefill: bool = True

    def __post_init__(self) -> None:
        check_compact_below(self.compact_below, "DecodeOptions")
        if not isinstance(self.share_prefill, bool):
            raise ValueError(f"DecodeOptions: share_prefill must be true or false, got {self.share_prefill!r}")


@torch.no_grad()
def sample(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    aux_generator: torch.Generator | None = None,
    options: DecodeOptions = DecodeOptions(),
) -> Generation:
    """Generate up to ``params.max_tokens`` tokens per row of a left-padded prompt batch.

    Tokens are drawn from ``softmax(top_p(logits / temperature))`` (``params.greedy`` takes the argmax of the raw
    logits instead) using ``generator`` for reproducibility (``params.seed`` is an engine's: it makes this
    generator); the recorded log-prob is the sampling distribution's (for greedy decoding: the
    temperature-scaled distribution's). ``options`` choose how the decode runs (``DecodeOptions``: dropping
    finished rows, the static cache, the shared prefill); the tokens are the same with each.

    On request it also records, per generated position, the ``params.topk`` most likely ids with their log-probs
    and ``params.aux_draws`` independent draws from ``aux_generator`` (``sampler_extras``; 0 on padding
    positions).
    """
    max_new_tokens, eos_token_id, pad_token_id = params.max_tokens, params.eos_token_id, params.pad_token_id
    temperature, top_p, greedy = params.temperature, params.top_p, params.greedy
    topk, aux_draws = params.topk, params.aux_draws
    drop_finished, compact_below = options.drop_finished, options.compact_below
    batch = input_ids.shape[0]
    device = input_ids.device
    attention_mask = attention_mask.long()
    positions = position_ids_from_mask(attention_mask)
    cache, logits = prefill(model, input_ids, attention_mask, positions, options.share_prefill)
    cache_kw = cache_argument(model)
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError("sample: the model's next-token logits for the prompts are not finite (NaN/inf): "
                                 "its weights or activations have diverged")
    decoder = None
    if options.static_cache and cache is not None and supports(model):
        decoder = StaticDecoder.from_prefill(model, cache, attention_mask, max_new_tokens)
        cache = None  # the prompt's keys/values now live in the decoder's cache
    can_drop = drop_finished and (decoder is not None or callable(getattr(cache, "batch_select_indices", None)))
    rows = torch.arange(batch, device=device)  # original row of each row of the forward batch
    next_pos = positions[:, -1:] + 1
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    ids, logps, masks, extras = [], [], [], []
    for step in range(max_new_tokens):
        if rows.numel() < batch:  # finished rows were dropped: scatter into a full-size [N, V] table
            logits = logits.new_zeros(batch, logits.shape[-1]).index_copy_(0, rows, logits)
        token, logp, logp_all = draw(logits, temperature, top_p, greedy, generator)
        active = ~finished
        if topk or aux_draws:
            extras.append(sampler_extras(logp_all, topk, aux_draws, aux_generator))
        token = torch.where(active, token, torch.full_like(token, pad_token_id))
        ids.append(token)
        logps.append(torch.where(active, logp, torch.zeros_like(logp)))
        masks.append(active)
        finished = finished | (token == eos_token_id)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        if can_drop:
            running = ~finished[rows]  # over the forward batch
            still = int(running.sum())
            if still < rows.numel() and still <= compact_below * rows.numel():
                keep = running.nonzero().squeeze(-1)
                if decoder is not None:
                    decoder.select(keep)
                else:
                    cache.batch_select_indices(keep)
                rows, attention_mask, next_pos = rows[keep], attention_mask[keep], next_pos[keep]
        if decoder is not None:  # finished rows' later logits are never used: no mask update needed
            logits = decoder.step(token[rows], next_pos)
        else:
            attention_mask = torch.cat([attention_mask, active[rows].long().unsqueeze(-1)], dim=-1)
            out = model(input_ids=token[rows].unsqueeze(-1), attention_mask=attention_mask, position_ids=next_pos,
                        use_cache=True, **{cache_kw: cache})
            cache, logits = returned_cache(out), out.logits[:, -1]
        next_pos = next_pos + 1
    mask = torch.stack(masks, dim=1)
    stacked = [None if column[0] is None else torch.stack(column, dim=1).masked_fill(~mask.unsqueeze(-1), 0)
               for column in zip(*extras)] if extras else [None, None, None]
    return Generation(
        response_ids=torch.stack(ids, dim=1),
        logprobs=torch.stack(logps, dim=1),
        mask=mask.long(),
        truncated=~finished,
        topk_ids=stacked[0], topk_logprobs=stacked[1], aux_ids=stacked[2],
    )
