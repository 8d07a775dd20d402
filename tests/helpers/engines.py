"""A rollout engine with an out-of-process engine's shape, for tests of the engine boundary."""

from __future__ import annotations

from rl_lightning.rollout import KVCacheEngine, RolloutEngine
from rl_lightning.rollout.engine import SESSIONS, TOPK
from rl_lightning.rollout.generation import Generation


class ListEngine(RolloutEngine):
    """An out-of-process engine's shape: it sees only token-id lists and named tensors, answers in lists (laid
    out by ``Generation.from_lists``) and says which weights it holds. Inside, a ``KVCacheEngine`` on its own
    copy of the policy (so its tokens can be compared with the built-in engine's)."""

    capabilities = frozenset({SESSIONS, TOPK})

    def __init__(self) -> None:
        self.inner = KVCacheEngine()
        self.loads: list[int] = []

    def setup(self, policy, dtype=None, version=0) -> None:  # noqa: ANN001
        self.inner.setup(policy, dtype, version)
        self.version = version

    def load_weights(self, named_tensors, version: int) -> None:  # noqa: ANN001
        self.inner.load_weights(dict(named_tensors), version)
        self.version = version
        self.loads.append(version)

    def generate(self, prompts, params, n=1) -> Generation:  # noqa: ANN001
        gen = self.inner.generate([list(p) for p in prompts], params, n)
        lengths = gen.mask.sum(1).tolist()
        out = Generation.from_lists([row[:k] for row, k in zip(gen.response_ids.tolist(), lengths)],
                                    [row[:k] for row, k in zip(gen.logprobs.tolist(), lengths)],
                                    gen.finish_reasons, params.pad_token_id)
        out.topk_ids, out.topk_logprobs = gen.topk_ids, gen.topk_logprobs
        return out

    def open_session(self, prompts, params, carry_cache=True):  # noqa: ANN001, ANN201
        return self.inner.open_session(prompts, params, carry_cache)
