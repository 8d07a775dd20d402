"""One LightningModule per method; ``RLModule`` is the shared base."""

from rl_lightning.algorithms.ac2 import AC2
from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.auxiliary import AuxiliaryRows
from rl_lightning.algorithms.base import RLModule
from rl_lightning.algorithms.checks import NonFiniteLossError, check_settings
from rl_lightning.algorithms.protocols import LossTerm
from rl_lightning.algorithms.bpco import BPCO
from rl_lightning.algorithms.cispo import CISPO
from rl_lightning.algorithms.cope import CoPE
from rl_lightning.algorithms.critic import CriticLearner
from rl_lightning.algorithms.evaluation import HeldoutEvaluation, HeldoutObserver
from rl_lightning.algorithms.forward import PolicyOutput
from rl_lightning.algorithms.metrics import Summed, TokenMean, clip_metrics
from rl_lightning.algorithms.easyppo import EasyPPO
from rl_lightning.algorithms.flash_reinforce import FlashREINFORCE
from rl_lightning.algorithms.grpo import GRPO
from rl_lightning.algorithms.gspo import GSPO
from rl_lightning.algorithms.lvrl import LVRL
from rl_lightning.algorithms.pg import PolicyGradient
from rl_lightning.algorithms.ppo import PPO
from rl_lightning.algorithms.reinforce import REINFORCE
from rl_lightning.algorithms.reinforce_pp import ReinforcePP
from rl_lightning.algorithms.rloo import RLOO
from rl_lightning.algorithms.sao import SAO
from rl_lightning.algorithms.score_centering import ScoreCentering
from rl_lightning.algorithms.spo import SPO
from rl_lightning.algorithms.stable_reinforce import StableReinforce
from rl_lightning.algorithms.tempo import TEMPO
from rl_lightning.algorithms.trpo import TRPO

__all__ = [
    "AC2", "Advantages", "AuxiliaryRows", "BPCO", "CISPO", "CriticLearner", "HeldoutEvaluation", "Summed", "TokenMean",
    "CoPE", "EasyPPO", "FlashREINFORCE", "GRPO", "GSPO", "LVRL", "PPO", "REINFORCE", "ReinforcePP", "RLOO", "SAO",
    "SPO", "ScoreCentering", "StableReinforce", "TEMPO", "TRPO", "HeldoutObserver", "LossTerm", "NonFiniteLossError",
    "PolicyGradient", "PolicyOutput", "RLModule", "check_settings", "clip_metrics",
]
