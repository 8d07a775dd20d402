"""``GradientCheckpointing``: trade compute for activation memory on every Hugging Face model a method trains."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from transformers import PreTrainedModel


class GradientCheckpointing(Callback):
    """Turn on Hugging Face gradient checkpointing for the policy and every other ``PreTrainedModel`` inside the
    module (a separate critic, a generative critic's own weights) when the fit starts.

    The forward of each decoder layer is recomputed in the backward instead of keeping its activations, so peak
    memory falls with the layer count at the cost of about one more forward per update. The update is the same
    (no dropout in the learner: the recomputed forward is the first one again). Add it with
    ``--trainer.callbacks+=GradientCheckpointing`` or in a config's ``trainer.callbacks``.

    Args:
        use_reentrant: PyTorch's checkpoint variant (``False``, the non-reentrant one, works with frozen inputs).
    """

    def __init__(self, use_reentrant: bool = False) -> None:
        self.use_reentrant = use_reentrant
        self.enabled: list[str] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.enabled = []
        for name, module in pl_module.named_modules():
            inside = any(name.startswith(f"{outer}.") for outer in self.enabled)  # e.g. a causal LM's decoder
            if isinstance(module, PreTrainedModel) and module.supports_gradient_checkpointing and not inside:
                module.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": self.use_reentrant})
                module.config.use_cache = False  # a cache is of no use in the learner's forward and conflicts
                self.enabled.append(name or type(module).__name__)
        if not self.enabled:
            raise ValueError("GradientCheckpointing: the module holds no Hugging Face model that supports it")
