"""Policy and critic construction: the tiny embedded default and local Hugging Face checkpoints."""

from rl_lightning.models.policy import build_tiny_policy, load_policy, resolve_model_path, tiny_llama_config
from rl_lightning.models.tokenizer import build_char_tokenizer

__all__ = ["build_char_tokenizer", "build_tiny_policy", "load_policy", "resolve_model_path", "tiny_llama_config"]
