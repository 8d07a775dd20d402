"""Tasks, environments and reward functions. Nothing here knows about training."""

from rl_lightning.envs.arithmetic import ArithmeticTask
from rl_lightning.envs.base import ExactMatchReward, Prompt, RewardError, RewardFunction, Task, score
from rl_lightning.envs.jsonl import JsonlTask, PromptFileError, read_prompt_file
from rl_lightning.envs.word_problems import ArithmeticWordTask, NumericAnswerReward

__all__ = [
    "ArithmeticTask",
    "ArithmeticWordTask",
    "ExactMatchReward",
    "JsonlTask",
    "NumericAnswerReward",
    "Prompt",
    "PromptFileError",
    "RewardError",
    "RewardFunction",
    "Task",
    "read_prompt_file",
    "score",
]
