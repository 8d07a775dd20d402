"""The built-in rollout engines: in-process, on a Hugging Face causal LM (the interface: ``rollout.engine``).

* ``KVCacheEngine`` (default): the library's own loop (``generation.sample``): one forward per new token on a
  KV cache, log-probs taken from the sampling logits themselves (no second pass), rows stopped at EOS and
  dropped from the forward batch (and the cache) once enough of them have finished.
* ``HFGenerateEngine``: Hugging Face ``model.generate`` as a reference; the log-probs are recomputed from
  the raw logits ``generate`` returns, under the same sampling distribution.

Both record log-probs of ``softmax(top_p(logits / temperature))``. For the same RNG state they draw the same
tokens (a test checks it), so either can serve as the other's reference. Their multi-turn sessions are the same
(``sessions.ModuleSession``). Plug one in with ``data.init_args.engine: {class_path:
rl_lightning.rollout.HFGenerateEngine}``.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from rl_lightning.functional.logprobs import sampling_log_softmax
from rl_lightning.rollout.engine import (
    AUX_DRAWS, IN_PROCESS, SESSIONS, TOPK, EngineSession, RolloutEngine, SamplingParams, check_capabilities,
    seeded,
)
from rl_lightning.rollout.generation import DEFAULT_COMPACT_BELOW, DecodeOptions, Generation, sample
from rl_lightning.rollout.sessions import ModuleSession, evaluating, left_pad

__all__ = ["HFGenerateEngine", "KVCacheEngine", "ModuleEngine", "RolloutEngine", "SamplingParams"]


class ModuleEngine(RolloutEngine):
    """An engine that generates with an ``nn.Module`` in this process: its own copy of the policy (``setup``),
    or a module it is bound to (``bound(policy)``: the learner's policy itself, whose current weights every
    rollout then sees with nothing to sync). Subclasses implement ``sample_padded``."""

    capabilities = frozenset({SESSIONS, IN_PROCESS})
    model: nn.Module | None = None

    def setup(self, policy: nn.Module, dtype: str | None = None, version: int = 0) -> None:
        self.model = copy.deepcopy(policy).requires_grad_(False).eval()
        if dtype is not None:
            self.model.to(getattr(torch, dtype))
        self.version = version

    def load_weights(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], version: int
                     ) -> None:
        state = named_tensors if isinstance(named_tensors, Mapping) else dict(named_tensors)
        self.model.load_state_dict(state)
        self.version = version

    def bound(self, model: nn.Module) -> ModuleEngine:
        """This engine (the same settings) generating with ``model`` itself."""
        engine = copy.copy(self)
        engine.model = model
        return engine

    def weights(self) -> Mapping[str, Tensor] | None:
        return None if self.model is None else self.model.state_dict()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1) -> Generation:
        check_capabilities(self, params.needs())
        ids, mask = left_pad([p for p in prompts for _ in range(n)], params.pad_token_id, self.device)
        aux = seeded(params.aux_seed, ids.device) if params.topk or params.aux_draws else None
        with evaluating(self.model):
            return self.sample_padded(self.model, ids, mask, params, seeded(params.seed, ids.device), aux)

    def open_session(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                     carry_cache: bool = True) -> EngineSession:
        return ModuleSession(self.model, prompts, params, carry_cache)

    @abstractmethod
    def sample_padded(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, params: SamplingParams,
                      generator: torch.Generator | None = None, aux_generator: torch.Generator | None = None
                      ) -> Generation:
        """Up to ``params.max_tokens`` per row of a left-padded prompt batch (``[N, P]`` ids and mask) on ``model``,
        drawn with ``generator`` (``params.seed`` made it); ``aux_generator`` draws ``params.aux_draws``."""


class KVCacheEngine(ModuleEngine):
    """The library's sampling loop (``rl_lightning.rollout.generation.sample``).

    Args:
        drop_finished: take rows that have emitted EOS out of the forward batch (the KV cache is cut to the
            running rows); the tokens drawn are the same either way.
        compact_below: cut once the running rows are at most this fraction of the forward batch (1.0: at
            every EOS; lower values copy the cache less often).
        static_cache: decode Llama / Qwen2 / Mistral models with ``StaticDecoder`` (a pre-allocated KV cache
            and no per-step Hugging Face machinery; same arithmetic); other models always use their forward.
        share_prefill: prefill identical prompts (a group's ``G`` rows) once and repeat their KV cache to every
            row (``generation.prefill``); the tokens drawn are the same either way.
    """

    capabilities = ModuleEngine.capabilities | {TOPK, AUX_DRAWS}

    def __init__(self, drop_finished: bool = True, compact_below: float = DEFAULT_COMPACT_BELOW,
                 static_cache: bool = True, share_prefill: bool = True) -> None:
        self.options = DecodeOptions(drop_finished, compact_below, static_cache, share_prefill)

    def sample_padded(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, params: SamplingParams,
                      generator: torch.Generator | None = None, aux_generator: torch.Generator | None = None
                      ) -> Generation:
        return sample(model, input_ids, attention_mask, params, generator, aux_generator, self.options)


class HFGenerateEngine(ModuleEngine):
    """``model.generate`` (sampling with temperature/top-p only: top-k, penalties and other processors off).

    Hugging Face samples from the global RNG; with a ``generator`` the draw runs under a forked RNG seeded
    from it, so results stay reproducible without touching the caller's global RNG. It records no extra sampler
    outputs (no ``TOPK``, ``AUX_DRAWS``).
    """

    @torch.no_grad()
    def sample_padded(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, params: SamplingParams,
                      generator: torch.Generator | None = None, aux_generator: torch.Generator | None = None
                      ) -> Generation:
        if params.topk or params.aux_draws:
            raise ValueError("HFGenerateEngine does not record extra sampler outputs (topk, aux_draws); use "
                             "KVCacheEngine")
        temperature, top_p, greedy, eos_token_id = params.temperature, params.top_p, params.greedy, params.eos_token_id
        config = GenerationConfig(
            do_sample=not greedy, temperature=temperature if not greedy else None,
            top_p=top_p if not greedy else None, top_k=0, max_new_tokens=params.max_tokens,
            eos_token_id=eos_token_id, pad_token_id=params.pad_token_id, output_logits=True,
            return_dict_in_generate=True,
        )
        devices = [input_ids.device] if input_ids.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=generator is not None):
            if generator is not None:
                torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)))
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        tokens = out.sequences[:, input_ids.shape[1]:]  # [N, T]
        logits = torch.stack(out.logits, dim=1)  # raw logits, [N, T, V]
        logprobs = sampling_log_softmax(logits, temperature, top_p).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        is_eos = tokens == eos_token_id
        before_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) == 0  # up to and including the first EOS
        truncated = ~is_eos.any(dim=1)
        mask = before_eos.long()
        return Generation(tokens.masked_fill(~before_eos, params.pad_token_id), logprobs * mask, mask, truncated)
