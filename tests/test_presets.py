"""Device presets (``configs/presets/*.yaml``) stack after a method's config as a second ``--config``.

GPU presets cannot build a ``Trainer`` on this CPU machine, so they are parsed with the real CLI parser
(``build_cli`` with class instantiation switched off) and their classes (model, strategy) instantiated by the
parser alone; the DDP preset is instantiated in full on CPU.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from jsonargparse import Namespace

from rl_lightning.cli import RLCLI, build_cli
from tests.conftest import REPO

GRPO = REPO / "configs" / "grpo.yaml"
PRESETS = REPO / "configs" / "presets"


def parse_only(*args: str) -> RLCLI:
    """``build_cli(args, run=False)`` up to the parsed, merged config: nothing is instantiated."""
    with mock.patch.object(RLCLI, "instantiate_classes", lambda self: None):
        return build_cli(list(args), run=False)


def instantiate(cli: RLCLI) -> Namespace:
    """The parser's own instantiation of every class in the config (model, data, callbacks, strategy) --
    everything ``LightningCLI`` builds except the ``Trainer`` itself."""
    parser = cli.parser
    return (parser.instantiate if hasattr(parser, "instantiate") else parser.instantiate_classes)(cli.config)


def stacked(*presets: str) -> list[str]:
    args = ["--config", str(GRPO)]
    for name in presets:
        args += ["--config", str(PRESETS / f"{name}.yaml")]
    return args


def test_the_presets_are_there():
    assert sorted(p.stem for p in PRESETS.glob("*.yaml")) == ["ddp", "fsdp", "gpu-bf16"]


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS.glob("*.yaml")))
def test_every_preset_stacks_after_grpo_and_keeps_the_method(preset):
    config = parse_only(*stacked(preset)).config
    assert config.model.class_path == "rl_lightning.algorithms.GRPO"  # a preset only adds, never replaces
    assert config.model.init_args.clip_eps_low == 0.2
    assert config.data.init_args.prompts_per_step == 16
    assert config.trainer.max_steps == 200


def test_ddp_preset_instantiates_in_full_on_cpu(tmp_path, monkeypatch):
    from lightning.pytorch.strategies import DDPStrategy

    monkeypatch.chdir(tmp_path)
    cli = build_cli([*stacked("ddp"), f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert cli.config.trainer.strategy == "ddp"
    assert cli.config.trainer.devices == 2 and cli.config.trainer.accelerator == "cpu"  # accelerator from grpo.yaml
    assert isinstance(cli.trainer.strategy, DDPStrategy)
    assert cli.trainer.world_size == 2 and cli.trainer.num_devices == 2
    assert cli.datamodule.prompts_per_step % cli.trainer.world_size == 0


def test_ddp_preset_devices_can_be_overridden_on_the_command_line():
    config = parse_only(*stacked("ddp"), "--trainer.devices", "8", "--trainer.num_nodes", "4").config
    # devices is typed list | str | int, so the command line's "8" stays a string (Lightning accepts both)
    assert (config.trainer.strategy, str(config.trainer.devices), config.trainer.num_nodes) == ("ddp", "8", 4)


def test_gpu_bf16_preset_sets_a_bf16_policy_on_one_gpu():
    cli = parse_only(*stacked("gpu-bf16"))
    assert (cli.config.trainer.accelerator, cli.config.trainer.devices) == ("gpu", 1)
    assert cli.config.model.init_args.dtype == "bfloat16"
    model = instantiate(cli).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_gpu_bf16_then_ddp_gives_bf16_ddp_on_gpus():
    config = parse_only(*stacked("gpu-bf16", "ddp")).config  # last value wins: devices 2 from ddp.yaml
    assert (config.trainer.accelerator, config.trainer.strategy, config.trainer.devices) == ("gpu", "ddp", 2)
    assert config.model.init_args.dtype == "bfloat16"


def test_fsdp_preset_builds_a_strategy_that_wraps_the_decoder_layers():
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import ShardingStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cli = parse_only(*stacked("fsdp"))
    trainer = cli.config.trainer
    assert trainer.strategy.class_path == "lightning.pytorch.strategies.FSDPStrategy"
    assert (trainer.accelerator, trainer.devices, trainer.precision) == ("gpu", 2, "bf16-mixed")
    assert cli.config.model.init_args.dtype == "float32"  # bf16-mixed keeps fp32 master weights
    built = instantiate(cli)
    strategy = built.trainer.strategy
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.sharding_strategy == ShardingStrategy.FULL_SHARD
    policy = strategy.kwargs["auto_wrap_policy"]  # Lightning turns the class set into a ModuleWrapPolicy
    assert LlamaDecoderLayer in policy._module_classes
    # the wrap policy names a class the default (embedded Llama) policy really contains
    assert any(isinstance(m, LlamaDecoderLayer) for m in built.model.policy.modules())
