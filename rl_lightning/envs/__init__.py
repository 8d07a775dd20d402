"""Tasks, environments and reward functions. Nothing here knows about training."""

from rl_lightning.envs.arithmetic import ArithmeticTask
from rl_lightning.envs.base import ExactMatchReward, Prompt, RewardError, RewardFunction, Task, score
from rl_lightning.envs.calculator import CalculatorEnv, CalculatorTask, calculate
from rl_lightning.envs.environment import EnvError, Environment, SingleTurnEnv
from rl_lightning.envs.guess import GuessNumberEnv, GuessNumberTask
from rl_lightning.envs.jsonl import JsonlTask, PromptFileError, read_prompt_file
from rl_lightning.envs.reach import ReachTargetEnv, ReachTargetTask
from rl_lightning.envs.running_sum import RunningSumReward, RunningSumTask
from rl_lightning.envs.word_problems import ArithmeticWordTask, NumericAnswerReward

__all__ = [
    "CalculatorEnv",
    "CalculatorTask",
    "ArithmeticTask",
    "ArithmeticWordTask",
    "EnvError",
    "Environment",
    "ExactMatchReward",
    "GuessNumberEnv",
    "GuessNumberTask",
    "JsonlTask",
    "NumericAnswerReward",
    "Prompt",
    "PromptFileError",
    "ReachTargetEnv",
    "ReachTargetTask",
    "RewardError",
    "RewardFunction",
    "RunningSumReward",
    "RunningSumTask",
    "SingleTurnEnv",
    "Task",
    "calculate",
    "read_prompt_file",
    "score",
]
