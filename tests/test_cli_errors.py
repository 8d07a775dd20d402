"""Every user error of the command line ends in one line naming the key, the file and line it came from, and
the problem; configuration errors exit with status 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rl_lightning import config_check
from rl_lightning.callbacks import compat
from rl_lightning.cli import join_negative_values, cli_main
from tests.conftest import REPO

GRPO = REPO / "configs" / "grpo.yaml"


def error_line(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(GRPO), *args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("rl-lightning: error")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err and "usage:" not in err
    return exit_info.value.code, lines[0]


def test_every_unknown_key_is_reported_with_the_closest_valid_name(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    text = GRPO.read_text().replace("    clip_eps_low: 0.2", "    clip_eps_lo: 0.2")
    bad.write_text(text)
    line_no = text.splitlines().index("    clip_eps_lo: 0.2") + 1
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(bad), "--data.init_args.grop_size", "2", "--trainer.max_step", "3"])
    assert exit_info.value.code == 2
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rl-lightning: error")][0]
    assert line == (
        f"rl-lightning: error: {bad}:{line_no}: model.init_args.clip_eps_lo: unknown key: GRPO has no argument "
        "'clip_eps_lo' (did you mean clip_eps_low?); command line: data.init_args.grop_size: unknown key: "
        "RolloutDataModule has no argument 'grop_size' (did you mean group_size?); command line: trainer.max_step: "
        "unknown key: Trainer has no argument 'max_step' (did you mean max_steps?)")


def test_a_flat_data_setting_points_to_its_group_and_a_group_field_typo_to_the_field(capsys, tmp_path):
    """The data module's settings are grouped (``sampling``, ``evaluation``, ...): a flat key of an older config
    names the group field it became, and an unknown field of a group is refused with the closest field, each with
    its file and line."""
    old = tmp_path / "old.yaml"
    old.write_text("data:\n  init_args:\n    sampler_sync_interval: 2\n    sampling:\n      temprature: 0.5\n")
    code, line = error_line(capsys, "--config", str(old), "--data.init_args.num_val_prompts", "3")
    assert code == 2
    assert line == (
        f"rl-lightning: error: {old}:5: data.init_args.sampling.temprature: unknown key: Sampling has no field "
        f"'temprature' (did you mean temperature?); {old}:3: data.init_args.sampler_sync_interval: unknown key: "
        "RolloutDataModule has no argument 'sampler_sync_interval' (a field of a settings group: did you mean "
        "data.init_args.sampling.sync_interval?); command line: data.init_args.num_val_prompts: unknown key: "
        "RolloutDataModule has no argument 'num_val_prompts' (a field of a settings group: did you mean "
        "data.init_args.evaluation.num_prompts?)")


def test_a_bad_group_value_names_its_full_key(capsys):
    code, line = error_line(capsys, "--data.init_args.sampling.temperature", "0")
    assert code == 2 and line.endswith("invalid data.init_args.sampling.temperature=0.0")


def test_a_wrong_type_names_the_key_the_expected_type_and_where_it_was_set(capsys, tmp_path):
    """jsonargparse's own message, cut to its innermost cause under the full key, with the key's file and line."""
    code, line = error_line(capsys, "--model.init_args.optimizer.init_args.lr", "fast")
    assert code == 2
    assert line == ("rl-lightning: error: command line: model.init_args.optimizer.init_args.lr: Expected a "
                    "<class 'float'>. Got value: fast")
    code, line = error_line(capsys, "--data.init_args.group_size", "many")
    assert (code, line) == (2, "rl-lightning: error: command line: data.init_args.group_size: Expected a "
                               "<class 'int'>. Got value: many")
    preset = tmp_path / "preset.yaml"
    preset.write_text("trainer:\n  callbacks:\n    - class_path: rl_lightning.callbacks.KLRegularizer\n"
                      "      init_args:\n        target: referense\n")
    code, line = error_line(capsys, "--config", str(preset))
    assert (code, line) == (2, f"rl-lightning: error: {preset}:5: trainer.callbacks[0].init_args.target: Expected a "
                               "typing.Literal['reference', 'sampler']. Got value: referense")


def test_a_negative_number_is_a_value_and_the_optimiser_refusing_it_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, line = error_line(capsys, "--model.init_args.optimizer.init_args.lr", "-1e-4", "--trainer.max_steps", "1")
    assert code == 2
    assert line == ("rl-lightning: error: model.init_args.optimizer: the optimiser refused its settings: "
                    "Invalid learning rate: -0.0001")


def test_the_optimizer_is_set_in_one_place_only(capsys):
    code, line = error_line(capsys, "--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.1")
    assert code == 2
    assert "optimizer: not accepted: set the optimizer in one place only, as model.init_args.optimizer" in line


def test_negative_values_are_joined_to_their_option():
    assert join_negative_values(["--a.lr", "-1e-4", "--b", "-3", "--c", "-.5", "--d", "x", "-x"]) == [
        "--a.lr=-1e-4", "--b=-3", "--c=-.5", "--d", "x", "-x"]
    assert join_negative_values(["--a=-1", "-2"]) == ["--a=-1", "-2"]  # already joined: left alone


def test_the_check_reads_a_classs_arguments_as_jsonargparse_does():
    from rl_lightning.algorithms import GRPO

    params = compat.signature_parameters(GRPO)  # along **kwargs up the hierarchy
    assert {"clip_eps_low", "model_name_or_path", "optimizer", "micro_batch_size"} <= set(params)
    assert "kwargs" not in params and params["clip_eps_low"] is float


@pytest.mark.parametrize("args, line", [
    (["--data.init_args.reward_fn", "rl_lightning.envs.NoSuchReward"],
     "command line: data.init_args.reward_fn: no class NoSuchReward in module rl_lightning.envs"),
    (["--data.init_args.reward_fn", '{"class_path": "mypkg.rewards.MyReward"}'],
     "command line: data.init_args.reward_fn.class_path: cannot import mypkg.rewards.MyReward "
     "(No module named 'mypkg')"),
    (["--model.class_path", "rl_lightning.algorithms.GRP0"],
     "command line: model.class_path: no class GRP0 in module rl_lightning.algorithms (did you mean GRPO?)"),
    (["--model", "GRP0"], "command line: model.class_path: no class named GRP0 (did you mean GRPO?)"),
    (["--model.init_args.optimizer.class_path", "torch.optim.SDG"],
     "command line: model.init_args.optimizer.class_path: no class SDG in module torch.optim (did you mean SGD?)"),
])
def test_a_bad_class_path_names_the_key_and_why_it_does_not_import(capsys, args, line):
    code, got = error_line(capsys, *args)
    assert (code, got) == (2, f"rl-lightning: error: {line}")


def test_a_bad_class_path_in_a_yaml_names_its_file_and_line(capsys, tmp_path):
    task = tmp_path / "reward.yaml"
    task.write_text("data:\n  init_args:\n    reward_fn: mypkg.rewards.MyReward\n")
    code, line = error_line(capsys, "--config", str(task))
    assert (code, line) == (2, f"rl-lightning: error: {task}:3: data.init_args.reward_fn: cannot import "
                               "mypkg.rewards.MyReward (No module named 'mypkg')")


def test_an_argument_a_subclass_sets_itself_is_refused_by_name(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "docs" / "examples"))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(REPO / "docs" / "examples" / "dr_grpo.yaml"),
                  "--model.init_args.scale_rewards", "true"])
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rl-lightning: error")]
    assert (exit_info.value.code, line) == (2, [
        "rl-lightning: error: command line: model.init_args.scale_rewards: unknown key: DrGRPO has no argument "
        "'scale_rewards' (DrGRPO sets it itself)"])


def test_an_option_for_the_last_callback_says_which_callback_takes_it(capsys):
    code, line = error_line(capsys, "--trainer.callbacks.init_args.beta", "0.01")
    assert (code, line) == (2, (
        "rl-lightning: error: command line: trainer.callbacks[2].init_args.beta: unknown key: StepCheckpoint has "
        "no argument 'beta'; --trainer.callbacks.beta sets the last callback of the list; to set KLRegularizer's: "
        "--trainer.callbacks+=KLRegularizer --trainer.callbacks.beta 0.01"))


def test_what_the_check_cannot_judge_keeps_jsonargparses_innermost_cause():
    message = """Parser key "data":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'rl_lightning.rollout.datamodule.RolloutDataModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'rl_lightning.rollout.RolloutDataModule':
        Parser key "task":
          Problem with given class_path 'rl_lightning.envs.ArithmeticTask':
            Parser key "operations":
              Does not validate against any of the Union subtypes
              Subtypes: [list[typing.Literal['+', '-', '*']], <class 'NoneType'>]
              Errors:
                - Expected a <class 'list'>
                - Expected a <class 'NoneType'>
              Given value type: <class 'str'>
              Given value: 5
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='task.init_args.operations', val='5')"""
    assert config_check.error_line(message, []) == "data.init_args.task.init_args.operations: Expected a <class 'list'>"
    message = """Parser key "trainer.logger":
  Does not validate against any of the Union subtypes
  Errors:
    - Problem with given class_path 'lightning.pytorch.loggers.TensorBoardLogger':
        Option 'bogus' is not accepted
    - Problem with given class_path 'lightning.pytorch.loggers.TensorBoardLogger':
        Option 'bogus' is not accepted
    - Expected a <class 'bool'>
  Given value: NestedArg(key='bogus', val='1')"""
    assert config_check.error_line(message, []) == "trainer.logger.init_args.bogus: Option 'bogus' is not accepted"


def test_a_prompt_file_line_without_an_answer_lists_its_keys(capsys, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "solution": "4"}\n')
    code, line = error_line(capsys, "--data.init_args.task", "rl_lightning.envs.JsonlTask",
                            "--data.init_args.task.init_args.train_file", str(data),
                            "--data.init_args.task.init_args.num_heldout", "1")
    assert code == 2
    assert line.endswith(f"{data}:2: missing field 'answer' (keys: ['prompt', 'solution'])")


# ---------------------------------------------------------------- Lightning's settings and missing packages: one line
@pytest.mark.parametrize("args, expected", [
    (["--trainer.max_steps", "-1"], "trainer.max_steps=-1: give the number of rollout steps"),
    (["--trainer.accumulate_grad_batches", "2"], "set model.init_args.micro_batch_size"),
    (["--trainer.logger", "lightning.pytorch.loggers.WandbLogger"], "wandb"),
    (["--config", "configs/presets/vllm.yaml"], ".venv-vllm/bin/rl-lightning"),
    (["--model.init_args.model_name_or_path", "HuggingFaceTB/SmolLM2-135M-Instruct"],
     "download it yourself (e.g. `hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir <dir>`)"),
])
def test_lightning_settings_and_missing_packages_fail_in_one_line(tmp_path, args, expected):
    """Each of these printed a 36-115-line traceback (or ran forever: max_steps -1) before."""
    import importlib.util

    if "wandb" in expected and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here: the logger would run")  # not the case in .venv
    if "vllm" in expected and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the engine would run")
    steps = [] if "--trainer.max_steps" in args else ["--trainer.max_steps", "1"]
    proc = subprocess.run([sys.executable, "-m", "rl_lightning", "fit", "--config", str(REPO / "configs/grpo.yaml"),
                           *args, *steps, "--trainer.logger.init_args.save_dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rl-lightning: error")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_checkpointing_off_drops_the_configs_checkpoint_callback_and_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rl_lightning", "fit", "--config", str(REPO / "configs/grpo.yaml"),
                           "--trainer.enable_checkpointing", "false", "--trainer.max_steps", "1",
                           "--trainer.val_check_interval", "1", "--data.init_args.evaluation.num_prompts", "8",
                           "--trainer.logger.init_args.save_dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the config's ModelCheckpoint is dropped" in proc.stderr + proc.stdout
    assert not list(tmp_path.rglob("*.ckpt"))


USER_MODULE = '''
from rl_lightning import ConfigError, check_settings
from rl_lightning.algorithms import GRPO
from rl_lightning.envs.base import RewardFunction
from rl_lightning.rollout import GroupRollout


class MyGRPO(GRPO):
    def __init__(self, floor: float = 0.1, refuse_data: bool = False, plain_error: bool = False, **kwargs):
        super().__init__(**kwargs)
        check_settings(self, [("floor", floor, floor > 0, "must be > 0")])
        self.refuse_data, self.plain_error = refuse_data, plain_error

    def check_datamodule(self, datamodule):
        if self.refuse_data:
            raise ConfigError("MyGRPO: data.init_args.group_size must be 16 for this method")
        if self.plain_error:
            raise ValueError("a plain ValueError from user code")


class PickyStrategy(GroupRollout):
    def rollout(self, ctx, batch):
        raise ConfigError("PickyStrategy: this task has no tools")


class PickyReward(RewardFunction):
    def __call__(self, prompt, response):
        raise ConfigError("PickyReward: the task has no reference answers")
'''


@pytest.mark.parametrize("args,expected", [
    (["--model.init_args.floor", "0"], "MyGRPO: floor must be > 0, got 0"),
    (["--model.init_args.refuse_data", "true"], "MyGRPO: data.init_args.group_size must be 16"),
    (["--data.init_args.strategy", "myext.PickyStrategy"], "PickyStrategy: this task has no tools"),
    (["--data.init_args.reward_fn", "myext.PickyReward"], "PickyReward: the task has no reference answers"),
])
def test_a_config_error_from_user_code_is_one_line_with_exit_2(tmp_path, args, expected):
    """A researcher's own class (constructor via check_settings, check_datamodule, a strategy, a reward function)
    raising ConfigError gets the library's one-line form; they printed 42-115-line tracebacks before."""
    (tmp_path / "myext.py").write_text(USER_MODULE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run([sys.executable, "-m", "rl_lightning", "fit", "--config", str(GRPO),
                           "--model", "myext.MyGRPO", *args, "--trainer.max_steps", "1",
                           "--trainer.logger.init_args.save_dir", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rl-lightning: error")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_a_plain_error_from_user_code_keeps_its_traceback(tmp_path):
    """Only ConfigError is a configuration error when user code raises it: a plain ValueError may be a bug."""
    (tmp_path / "myext.py").write_text(USER_MODULE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run([sys.executable, "-m", "rl_lightning", "fit", "--config", str(GRPO),
                           "--model", "myext.MyGRPO", "--model.init_args.plain_error", "true",
                           "--trainer.max_steps", "1", "--trainer.logger.init_args.save_dir", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "a plain ValueError from user code" in proc.stderr
