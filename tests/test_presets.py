"""Device presets (``configs/presets/*.yaml``) and task presets (``configs/tasks/*.yaml``) stack after a
method's config as a second ``--config``.

GPU presets cannot build a ``Trainer`` on this CPU machine, so they are parsed with the real CLI parser
(``build_cli`` with class instantiation switched off) and their classes (model, strategy) instantiated by the
parser alone; the DDP preset is instantiated in full on CPU. The hard task preset is instantiated in full after
every method's config, and its warm start is checked to be right 10-25 % of the time on the preset's held-out set.
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
    assert sorted(p.stem for p in PRESETS.glob("*.yaml")) == ["cpu-bf16", "ddp", "fsdp", "gpu-bf16", "lora", "vllm",
                                                                  "vllm_server"]


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


def test_cpu_bf16_preset_keeps_fp32_weights_and_samples_from_a_bf16_copy(tmp_path, monkeypatch):
    """bf16 autocast in the update over fp32 weights, a bf16 sampler copy, every other sampling setting the
    method's; two steps run on the CPU, the learner's parameters stay fp32 and move."""
    monkeypatch.chdir(tmp_path)
    cli = build_cli([*stacked("cpu-bf16"), "--trainer.max_steps", "2", "--trainer.logger", "false",
                     "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0",
                     "--trainer.callbacks", "[]", f"--trainer.default_root_dir={tmp_path}"], run=False)
    sampling = cli.config.data.init_args.sampling
    assert (cli.config.trainer.precision, sampling.dtype) == ("bf16-mixed", "bfloat16")
    plain = parse_only(*stacked()).config.data.init_args.sampling
    assert (sampling.max_new_tokens, sampling.temperature) == (plain.max_new_tokens, plain.temperature)  # grpo.yaml's
    before = [p.detach().clone() for p in cli.model.policy.parameters()]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = list(cli.model.policy.parameters())
    assert {p.dtype for p in after} == {torch.float32}
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    from tests.tolerances import decoder_logprob_bound

    # the bf16 paths are on: the sampler/learner gap is above what fp32 alone allows (0.0064 seen), and it stays
    # rounding, far from another policy (whose log-probs differ by nats)
    policy = cli.model.policy
    fp32 = decoder_logprob_bound(policy, sampling.temperature, policy.config.max_position_embeddings)
    diff = float(cli.trainer.callback_metrics["train/sampler_logp_diff"])
    assert fp32 < diff < 0.1, (fp32, diff)


def test_bf16_on_a_cpu_without_native_bf16_products_is_named_in_one_warning(monkeypatch):
    from rl_lightning.algorithms import checks

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(checks, "native_bf16", lambda: False)
    with pytest.warns(UserWarning) as seen:
        message = checks.warn_emulated_bf16(cpu, "bf16-mixed", "float32", "bfloat16")
    assert [str(w.message) for w in seen] == [message] and "\n" not in message
    assert message.startswith("trainer.precision: bf16-mixed, data.init_args.sampling.dtype: bfloat16 on a CPU without")
    assert "model.init_args.dtype" in checks.warn_emulated_bf16(cpu, "32-true", "bfloat16", None)
    assert checks.warn_emulated_bf16(cpu, "32-true", "float32", None) is None  # nothing in bf16
    assert checks.warn_emulated_bf16(gpu, "bf16-mixed", "bfloat16", "bfloat16") is None  # not a CPU
    monkeypatch.setattr(checks, "native_bf16", lambda: True)
    assert checks.warn_emulated_bf16(cpu, "bf16-mixed", "bfloat16", "bfloat16") is None  # native products


@pytest.mark.parametrize("cap, native", [(None, True), ("ALL", True), ("avx512_core_bf16", True),
                                         ("AVX512_CORE_AMX", True), ("AVX512_CORE", False), ("AVX2", False)])
def test_native_bf16_follows_the_cpu_and_onednns_instruction_set_cap(cap, native, monkeypatch):
    from rl_lightning.algorithms import checks

    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert checks.native_bf16() is native
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert checks.native_bf16() is False  # no bf16 instructions, whatever the cap


def test_a_fit_with_the_cpu_bf16_preset_warns_where_bf16_is_emulated(tmp_path, monkeypatch):
    from rl_lightning.algorithms import checks

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(checks, "native_bf16", lambda: False)
    cli = build_cli([*stacked("cpu-bf16"), "--trainer.max_steps", "1", "--trainer.logger", "false",
                     "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0",
                     "--trainer.callbacks", "[]", f"--trainer.default_root_dir={tmp_path}"], run=False)
    with pytest.warns(UserWarning, match="sampling.dtype: bfloat16 on a CPU without native bf16"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def test_fsdp_preset_builds_fsdp2_over_every_device():
    """The preset is FSDP2 through ModelParallelStrategy (what tests/test_fsdp.py runs on CPU), with full-file
    checkpoints; the blocks it shards (the policy's _no_split_modules) are classes the embedded policy contains."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cli = parse_only(*stacked("fsdp"))
    trainer = cli.config.trainer
    assert trainer.strategy.class_path == "lightning.pytorch.strategies.ModelParallelStrategy"
    assert (trainer.accelerator, trainer.devices) == ("gpu", 2)
    assert trainer.strategy.init_args.data_parallel_size == trainer.devices
    built = instantiate(cli)
    strategy = built.trainer.strategy
    assert (isinstance(strategy, ModelParallelStrategy)
            and trainer.strategy.init_args.save_distributed_checkpoint is False)
    blocks = set(built.model.policy._no_split_modules)
    assert "LlamaDecoderLayer" in blocks and any(isinstance(m, LlamaDecoderLayer) for m in built.model.policy.modules())


# ---------------------------------------------------------------- task presets (configs/tasks/*.yaml)
METHODS = ["pg", "reinforce", "rloo", "grpo", "ppo", "trpo", "flash_reinforce", "spo", "cope"]
TASKS = REPO / "configs" / "tasks"
HARD = TASKS / "arithmetic_hard.yaml"


def _as_dict(cli: RLCLI) -> dict:
    """The resolved config, less the list of ``--config`` files it came from."""
    config = cli.config.clone().as_dict()
    config.pop("config", None)
    return config


def _differences(a: object, b: object, path: str = "") -> set[str]:
    """Dotted keys whose values differ between two nested dicts."""
    if isinstance(a, dict) and isinstance(b, dict):
        return set().union(*[_differences(a.get(k), b.get(k), f"{path}.{k}" if path else k) for k in {*a, *b}])
    return set() if a == b else {path}


def test_the_task_presets_are_there():
    assert {"arithmetic_hard", "calculator", "guess"} <= {p.stem for p in TASKS.glob("*.yaml")}


def test_each_task_preset_writes_its_runs_under_its_own_name():
    """So that ``--ckpt_path last`` after stacking a task preset finds a run of that task, not the method's."""
    stacks = {"guess": ["grpo", "guess"], "calculator": ["grpo", "calculator"],
              "arithmetic_hard": ["grpo", "arithmetic_hard"], "guess_ppo": ["ppo", "guess", "guess_ppo"],
              "guess_grpo": ["grpo", "guess", "guess_grpo"],
              "guess_reinforce": ["reinforce", "guess", "guess_reinforce"],
              "sao_arithmetic": ["sao", "sao_arithmetic"],
              "calculator_tempo": ["tempo", "calculator", "calculator_tempo"],
              "guess_lvrl": ["lvrl", "guess", "guess_lvrl"],
              "arithmetic_hard_ac2": ["ac2", "arithmetic_hard", "arithmetic_hard_ac2"],
              "reach": ["grpo", "reach"], "reach_tempo": ["tempo", "reach", "reach_tempo"],
              "reach_ac2": ["ac2", "reach", "reach_ac2"], "reach_cope": ["cope", "reach", "reach_cope"],
              "running_sum": ["grpo", "running_sum"],
              "smollm2_words": ["grpo_smollm2", "smollm2_words"]}
    assert set(stacks) == {p.stem for p in TASKS.glob("*.yaml")}
    for name, (method, *tasks) in stacks.items():
        args = ["--config", str(REPO / "configs" / f"{method}.yaml")]
        for task in tasks:
            args += ["--config", str(TASKS / f"{task}.yaml")]
        logger = parse_only(*args).config.trainer.logger
        assert logger.class_path.endswith("TensorBoardLogger") and logger.init_args.save_dir == "runs"
        assert logger.init_args.name == name


@pytest.mark.parametrize("task, turns, budget", [("calculator", 3, 32), ("reach", 10, 60)])
def test_tempo_on_a_task_preset_keeps_its_branch_rollout(task, turns, budget):
    """A task preset sets a GroupRollout; TEMPO's preset for the task sets its BranchRollout back, with the task's
    turns and budget and n = data.group_size, and keeps its generative critic."""
    config = parse_only("--config", str(REPO / "configs" / "tempo.yaml"), "--config", str(TASKS / f"{task}.yaml"),
                        "--config", str(TASKS / f"{task}_tempo.yaml")).config
    strategy = config.data.init_args.strategy
    assert strategy.class_path == "rl_lightning.rollout.BranchRollout"
    assert strategy.init_args.n == config.data.init_args.group_size == 4
    assert strategy.init_args.max_turns == turns and strategy.init_args.max_episode_tokens == budget
    assert config.model.init_args.critic.class_path.endswith("GenerativeCritic")


@pytest.mark.parametrize("method", METHODS)
def test_the_hard_task_preset_changes_only_the_task_and_the_model(method):
    base = parse_only("--config", str(REPO / "configs" / f"{method}.yaml"))
    hard = parse_only("--config", str(REPO / "configs" / f"{method}.yaml"), "--config", str(HARD))
    assert _differences(_as_dict(base), _as_dict(hard)) == {
        "model.init_args.model_name_or_path", "data.init_args.task.init_args.num_digits",
        "trainer.logger.init_args.name"}
    assert hard.config.trainer.logger.init_args.name == "arithmetic_hard"  # its own runs
    assert hard.config.model.init_args.model_name_or_path == "embedded:arithmetic_hard"
    assert hard.config.data.init_args.task.init_args.num_digits == 3


@pytest.mark.parametrize("method", METHODS)
def test_every_method_with_the_hard_task_preset_instantiates(method, tmp_path, monkeypatch):
    from rl_lightning.algorithms import RLModule
    from rl_lightning.envs import ArithmeticTask
    from rl_lightning.rollout import RolloutDataModule

    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--config", str(REPO / "configs" / f"{method}.yaml"), "--config", str(HARD),
                     f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert isinstance(cli.model, RLModule) and cli.model.hparams.model_name_or_path == "embedded:arithmetic_hard"
    assert isinstance(cli.datamodule, RolloutDataModule)
    task = cli.datamodule.task
    assert isinstance(task, ArithmeticTask) and (task.num_digits, task.operations) == (3, ["+"])
    assert cli.trainer.max_steps > 0


def test_the_hard_warm_start_is_right_10_to_25_percent_of_the_time_on_the_presets_heldout_set():
    """Greedy exact match of ``embedded:arithmetic_hard`` on the first 200 of the preset's held-out prompts, as
    ``val/reward`` computes it (BOS + prompt, greedy, cut at EOS). Deterministic: 0.200 on these 200 and on
    all 500 (``warm_start.json``; the 2-digit warm start ``embedded:arithmetic`` scores 0.0 on them)."""
    from rl_lightning.models.policy import load_policy
    from rl_lightning.rollout import SamplingParams, sample

    data = instantiate(parse_only("--config", str(GRPO), "--config", str(HARD))).data
    task = data.task
    prompts = task.heldout_prompts()[:200]
    assert len(prompts[0].text) == len("123+456=")  # 3-digit operands
    reward = task.default_reward()
    model, tok = load_policy("embedded:arithmetic_hard")
    model.eval()
    rows = [[tok.bos_token_id, *tok(p.text, add_special_tokens=False)["input_ids"]] for p in prompts]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = sample(model, input_ids, attention_mask, SamplingParams(
        max_tokens=data.sampling.max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        greedy=True))
    correct = 0
    for prompt, ids, mask in zip(prompts, out.response_ids.tolist(), out.mask.tolist()):
        ids = [i for i, m in zip(ids, mask) if m and i != tok.eos_token_id]
        correct += reward(prompt, tok.decode(ids, skip_special_tokens=False))
    accuracy = correct / len(prompts)
    assert 0.10 <= accuracy <= 0.25, accuracy


# ------------------------------------------------------------------------------------------- stacked callbacks
def _names(config: Namespace) -> list[str]:
    return [c.class_path.rsplit(".", 1)[-1] for c in config.trainer.callbacks]


def test_a_stacked_config_with_callbacks_adds_to_the_methods_list_instead_of_replacing_it(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("trainer:\n  callbacks:\n"
                     "    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
                     "    - class_path: rl_lightning.callbacks.RolloutSamples\n"
                     "      init_args:\n        num_samples: 4\n")
    config = parse_only("--config", str(REPO / "configs" / "sao.yaml"), "--config", str(extra)).config
    assert _names(config) == ["CriticWarmup", "FreezeCriticModules", "RolloutSamples", "StepCheckpoint",
                              "LearningRateMonitor"]
    samples = config.trainer.callbacks[2].init_args  # a class already in the list: updated in place
    assert (samples.every_n_steps, samples.num_samples) == (10, 4)
    assert config.trainer.callbacks[0].init_args.steps == 10


def test_a_task_preset_with_callbacks_keeps_the_callbacks_the_run_needs(tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import LearningRateMonitor

    from rl_lightning.callbacks import CriticWarmup, KLRegularizer, RolloutSamples, StepCheckpoint

    monkeypatch.chdir(tmp_path)
    extra = tmp_path / "extra.yaml"
    extra.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n")
    cli = build_cli(["--config", str(REPO / "configs" / "easyppo.yaml"), "--config", str(HARD), "--config",
                     str(extra)], run=False)
    kinds = [type(cb) for cb in cli.trainer.callbacks]
    for kind in (CriticWarmup, KLRegularizer, RolloutSamples, StepCheckpoint, LearningRateMonitor):
        assert kinds.count(kind) == 1, kind
    assert kinds.index(CriticWarmup) < kinds.index(KLRegularizer) < kinds.index(RolloutSamples)


@pytest.mark.parametrize("args", [
    ["--trainer.callbacks+=KLRegularizer", "--trainer.callbacks.beta", "0.01"],
    ["--trainer.callbacks+", "rl_lightning.callbacks.KLRegularizer", "--trainer.callbacks.init_args.beta=0.01"],
    ["--config", '{"trainer": {"callbacks": [{"class_path": "KLRegularizer", "init_args": {"beta": 0.01}}]}}'],
])
def test_the_kl_penalty_is_turned_on_from_the_command_line_in_the_configs_own_entry(args):
    config = parse_only("--config", str(REPO / "configs" / "stable_reinforce.yaml"), *args).config
    assert _names(config) == ["KLRegularizer", "RolloutSamples", "StepCheckpoint"]
    kl = config.trainer.callbacks[0].init_args
    assert (kl.beta, kl.estimator, kl.target) == (0.01, "k1", "sampler")  # the config's other settings stay


def test_an_added_callback_takes_the_options_after_it_and_the_list_can_still_be_replaced():
    config = parse_only(*stacked(), "--trainer.callbacks+=LearningRateMonitor", "--trainer.max_steps", "7",
                        "--trainer.callbacks.logging_interval", "step").config
    assert _names(config) == ["KLRegularizer", "RolloutSamples", "StepCheckpoint", "LearningRateMonitor"]
    assert config.trainer.callbacks[3].init_args.logging_interval == "step"
    assert config.trainer.max_steps == 7
    config = parse_only(*stacked(), "--trainer.callbacks=[LearningRateMonitor]").config
    assert _names(config) == ["LearningRateMonitor"]


@pytest.mark.parametrize("preset, engine", [("vllm", "VLLMEngine"), ("vllm_server", "VLLMServerEngine")])
def test_the_vllm_presets_build_their_engine_without_vllm_installed(preset, engine):
    data = instantiate(parse_only(*stacked(preset))).data
    assert type(data.engine).__name__ == engine and data.engine.version == -1  # nothing started before setup
