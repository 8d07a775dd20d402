"""The calculator tool-use task's preset ``configs/tasks/calculator.yaml`` stacked on each method, and its shipped
warm start ``embedded:calculator``: greedy held-out success in [0.20, 0.50] through ``Trainer.validate``, a
tool-call rate that leaves RL room (it still answers most problems directly), and rollouts in the layout the
warm start was trained on (``experiments/warm_start_calculator.py``)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
import yaml

from rl_lightning.envs import CalculatorTask
from tests.conftest import REPO
from tests.helpers.settings import data_kwargs

PRESET = REPO / "configs" / "tasks" / "calculator.yaml"


def _record() -> dict:
    from rl_lightning.models.policy import ASSETS

    return json.loads((ASSETS / "calculator" / "warm_start.json").read_text())


def _preset_datamodule(**overrides):
    """The data module the preset configures (task, strategy, sampling, evaluation), built from the
    YAML itself so the test follows it."""
    from rl_lightning.rollout import Evaluation, GroupRollout, RolloutDataModule, Sampling

    data = yaml.safe_load(PRESET.read_text())["data"]["init_args"]
    assert data["task"]["class_path"] == "rl_lightning.envs.CalculatorTask"
    assert data["strategy"]["class_path"] == "rl_lightning.rollout.GroupRollout"
    kwargs = dict(task=CalculatorTask(**data["task"]["init_args"]),
                  strategy=GroupRollout(**data["strategy"]["init_args"]),
                  sampling=Sampling(**data["sampling"]), evaluation=Evaluation(**data["evaluation"]))
    kwargs.update(overrides)
    return RolloutDataModule(**data_kwargs(**kwargs))


@pytest.fixture(scope="module")
def heldout_rollouts():
    """Greedy rollouts of the shipped warm start on the preset's held-out problems (the validation path)."""
    from rl_lightning.models.policy import load_policy

    model, tok = load_policy("embedded:calculator")
    model.eval()
    dm = _preset_datamodule()
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(policy=model, tokenizer=tok),
                                 global_rank=0, world_size=1)
    with torch.no_grad():
        batches = [dm.rollout(b) for b in dm.val_prompt_batches()]
    return batches, tok


def _episodes(batches, tok) -> list[tuple[str, float]]:
    """``(text of the episode as the model saw it, reward)`` of every held-out episode."""
    out = []
    for batch in batches:
        for row in range(batch.num_rows):
            ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
            out.append((tok.decode(ids, skip_special_tokens=False), float(batch.rewards[row])))
    return out


# ---------------------------------------------------------------------------------------------------------- preset
@pytest.mark.parametrize("method", ["grpo", "reinforce", "ppo"])
def test_the_preset_stacks_on_each_method(method):
    from unittest import mock

    from rl_lightning.cli import RLCLI, build_cli

    args = ["--config", str(REPO / "configs" / f"{method}.yaml"), "--config", str(PRESET)]
    with mock.patch.object(RLCLI, "instantiate_classes", lambda self: None):
        config = build_cli(args, run=False).config
    classes = {"grpo": "GRPO", "reinforce": "REINFORCE", "ppo": "PPO"}
    assert config.model.class_path == f"rl_lightning.algorithms.{classes[method]}"
    assert config.model.init_args.model_name_or_path == "embedded:calculator"
    data = config.data.init_args
    assert data.task.class_path == "rl_lightning.envs.CalculatorTask"
    # the arithmetic task's num_heldout: 500 would carry over to the shared argument: the preset pins it
    assert dict(vars(data.task.init_args)) == {"num_heldout": 100, "max_calls": 2, "seed": 1234}
    assert data.strategy.class_path == "rl_lightning.rollout.GroupRollout"
    assert data.strategy.init_args.max_turns == 3 == data.task.init_args.max_calls + 1
    assert data.sampling.max_new_tokens == 6 and data.evaluation.batch_size >= 100
    # the preset's own runs (run scripts pass their own name)
    assert config.trainer.logger.init_args.name == "calculator"


def test_the_longest_episode_fits_the_tiny_llama():
    """The longest first observation, and 3 turns cut at max_new_tokens without EOS, the first two answered with
    the longest observation a 6-token call can produce ("c99999" -> "=99999:"), stay within the episode budget
    and the model's 64 positions; a well-formed call and its answer fit in one turn each."""
    from rl_lightning.envs import calculate
    from rl_lightning.models.policy import load_policy

    dm = _preset_datamodule()
    model, tok = load_policy("embedded:calculator")
    n = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    first = 1 + max(n(p.text) for p in dm.task.heldout_prompts() + [dm.task.make_prompt(99, 9)])
    longest_obs = max(n(f"={calculate(e)}:") for e in ("99999", "99*99", "9*9*9", "1-999"))
    assert longest_obs == n("=99999:") == 7
    worst = 3 * dm.sampling.max_new_tokens + 2 * longest_obs
    assert worst <= dm.strategy.max_episode_tokens
    assert first + dm.strategy.max_episode_tokens <= model.config.max_position_embeddings == 64
    assert n("c99*9") + 1 <= dm.sampling.max_new_tokens and n("891") + 1 <= dm.sampling.max_new_tokens


# ---------------------------------------------------------------------------------------------------------- warm start
def test_the_warm_start_asset_is_the_tiny_llama_with_the_char_tokenizer():
    from transformers import LlamaForCausalLM

    from rl_lightning.models.policy import ASSETS, load_policy

    model, tok = load_policy("embedded:calculator")
    assert isinstance(model, LlamaForCausalLM) and model.config.max_position_embeddings == 64
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 1_200_000
    assert tok("37*8=c37*8=296:", add_special_tokens=False)["input_ids"] == [
        tok.convert_tokens_to_ids(c) for c in "37*8=c37*8=296:"]
    assert (ASSETS / "calculator" / "model.safetensors").stat().st_size < 5 * 1024 * 1024
    record = _record()
    assert record["task"] == {"class": "CalculatorTask", "num_heldout": 100, "max_calls": 2, "seed": 1234}
    assert record["rollout"] == {"strategy": "GroupRollout", "max_turns": 3, "max_episode_tokens": 32,
                                 "max_new_tokens": 6}
    assert record["layout_check"]["episodes_with_a_tool_call"] > 0


def test_the_warm_start_succeeds_20_to_50_percent_of_the_time_greedy_on_the_heldout_set(tmp_path):
    """``val/reward`` of ``Trainer.validate(GRPO(embedded:calculator))`` with the preset's data module: the greedy
    held-out success the runs log at step 0. Deterministic: 32 of 100 problems (``warm_start.json``)."""
    import lightning.pytorch as pl

    from rl_lightning.algorithms import GRPO

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.validate(GRPO(model_name_or_path="embedded:calculator"), datamodule=_preset_datamodule(), verbose=False)
    success = float(trainer.callback_metrics["val/reward"])
    assert 0.20 <= success <= 0.50, success
    record = _record()
    assert success == pytest.approx(record["heldout_greedy_success"], abs=1e-6)
    assert record["sampled_success"]["success"] > 0.1  # RL needs successes within its groups


def test_the_warm_start_calls_the_tool_on_some_heldout_problems_and_answers_most_directly(heldout_rollouts):
    """Greedy, held-out: the share of episodes whose first turn is a tool call is what ``warm_start.json``
    recorded (0.24), between 0.10 and 0.50; tool calls are nearly always right, direct answers mostly wrong."""
    episodes = _episodes(*heldout_rollouts)
    assert len(episodes) == 100
    tool = [(text, r) for text, r in episodes if re.match(r"^<bos>\d+\*\d=c", text)]
    direct = [(text, r) for text, r in episodes if (text, r) not in tool]
    rate = len(tool) / len(episodes)
    record = _record()["heldout_greedy"]
    assert rate == pytest.approx(record["tool_call_rate"]) and 0.10 <= rate <= 0.50, rate
    tool_success = sum(r for _, r in tool) / len(tool)
    direct_success = sum(r for _, r in direct) / len(direct)
    assert tool_success == pytest.approx(record["success_with_tool"], abs=1e-4) and tool_success >= 0.9
    assert direct_success == pytest.approx(record["success_direct"], abs=1e-4) and direct_success < 0.5


def test_heldout_episodes_are_in_the_layout_the_warm_start_was_trained_on(heldout_rollouts):
    """``<bos>37*8=c37*8<eos>=296:296<eos>`` (the call's result right after its EOS) or ``<bos>37*8=296<eos>``;
    a right tool-use episode called the tool on its own problem and copied the result."""
    episodes = _episodes(*heldout_rollouts)
    tool_use = re.compile(r"^<bos>(\d+)\*(\d)=c([^<]*)<eos>=(-?\d+|\?):(\d+)<eos>$")
    direct = re.compile(r"^<bos>(\d+)\*(\d)=(\d+)<eos>$")
    right_calls = 0
    for text, reward in episodes:
        if m := tool_use.match(text):
            a, b, call, result, answer = m.groups()
            assert reward == float(int(answer) == int(a) * int(b)), text
            if reward == 1.0 and call == f"{a}*{b}":
                assert result == answer, text
                right_calls += 1
        else:
            m = direct.match(text)
            assert m, text
            assert reward == float(int(m.group(3)) == int(m.group(1)) * int(m.group(2))), text
    assert right_calls >= 10
