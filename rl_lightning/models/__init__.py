"""Policy and critic construction: the tiny embedded default and local Hugging Face checkpoints."""

from rl_lightning.models.policy import build_tiny_policy, load_policy, resolve_model_path, tiny_llama_config
from rl_lightning.models.tokenizer import build_char_tokenizer
from rl_lightning.models.value import Critic, CriticMode, ValueHead, build_critic

__all__ = ["Critic", "CriticMode", "ValueHead", "build_char_tokenizer", "build_critic", "build_tiny_policy",
           "load_policy", "resolve_model_path", "tiny_llama_config"]
