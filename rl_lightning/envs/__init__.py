"""Tasks, environments and reward functions. Nothing here knows about training."""

from rl_lightning.envs.arithmetic import ArithmeticTask
from rl_lightning.envs.base import ExactMatchReward, Prompt, RewardError, RewardFunction, Task, score
from rl_lightning.envs.calculator import CalculatorEnv, CalculatorTask, calculate
from rl_lightning.envs.environment import EnvError, Environment, SingleTurnEnv
from rl_lightning.envs.hf_data import DatasetTask, load_local_dataset
from rl_lightning.envs.guess import GuessNumberEnv, GuessNumberTask
from rl_lightning.envs.jsonl import JsonlTask, PromptFileError, read_prompt_file
from rl_lightning.envs.reach import ReachTargetEnv, ReachTargetTask
from rl_lightning.envs.running_sum import RunningSumReward, RunningSumTask
from rl_lightning.envs.rewards import WeightedRewards, score_parts
from rl_lightning.envs.verifiers import BoxedFormatReward, MathVerifyReward
from rl_lightning.envs.word_problems import ArithmeticWordTask, NumericAnswerReward

__all__ = [
    "BoxedFormatReward",
    "CalculatorEnv",
    "CalculatorTask",
    "ArithmeticTask",
    "ArithmeticWordTask",
    "DatasetTask",
    "EnvError",
    "Environment",
    "ExactMatchReward",
    "GuessNumberEnv",
    "GuessNumberTask",
    "JsonlTask",
    "MathVerifyReward",
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
    "WeightedRewards",
    "calculate",
    "load_local_dataset",
    "read_prompt_file",
    "score",
    "score_parts",
]
