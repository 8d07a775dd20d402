"""The command line: every config parses, --print_config works, bad input fails early, a short fit logs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rl_lightning.cli import build_cli
from tests.conftest import REPO

CONFIGS = sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "configs" / "ablations").glob("*.yaml")])
TINY = [
    "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
    "--data.init_args.task.init_args.num_heldout", "16", "--data.init_args.prompts_per_step", "4",
    "--data.init_args.group_size", "4", "--data.init_args.sampling.max_new_tokens", "4",
]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "rl_lightning", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_there_are_configs():
    assert any(p.name == "grpo.yaml" for p in CONFIGS)


def _uses_the_embedded_model(config: Path) -> bool:
    return "model_name_or_path: embedded:" in config.read_text()


@pytest.mark.parametrize("config", [c for c in CONFIGS if _uses_the_embedded_model(c)], ids=lambda p: p.name)
def test_every_embedded_config_parses_and_instantiates(config, tmp_path):
    cli = build_cli(["--config", str(config), f"--trainer.default_root_dir={tmp_path}"], run=False)
    from rl_lightning.algorithms import RLModule
    from rl_lightning.rollout import RolloutDataModule

    assert isinstance(cli.model, RLModule)
    assert isinstance(cli.datamodule, RolloutDataModule)
    assert cli.trainer.max_steps > 0


@pytest.mark.parametrize("config", [c for c in CONFIGS if not _uses_the_embedded_model(c)], ids=lambda p: p.name)
def test_configs_for_local_checkpoints_parse(config):
    """Configs naming a local checkpoint (built by an experiments/ script) must parse on any machine; their
    model is only loaded where the checkpoint exists (the slow tests do that)."""
    from unittest import mock

    from rl_lightning.cli import RLCLI

    with mock.patch.object(RLCLI, "instantiate_classes", lambda self: None):
        cli = build_cli(["--config", str(config)], run=False)
    model = cli.config["model"]
    assert model["class_path"].startswith("rl_lightning.algorithms")
    assert not str(model["init_args"]["model_name_or_path"]).startswith("embedded:")


def test_print_config_prints_the_resolved_config(tmp_path):
    proc = _cli("fit", "--config", str(REPO / "configs" / "grpo.yaml"), "--trainer.max_steps", "7",
                "--print_config", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "class_path: rl_lightning.algorithms.GRPO" in proc.stdout
    assert "max_steps: 7" in proc.stdout
    assert "logprob_chunk_size: 256" in proc.stdout  # base-class defaults are resolved too
    short = _cli("fit", "--config", str(REPO / "configs" / "grpo.yaml"), "--trainer.max_steps", "7",
                 "--print_config=skip_default", cwd=tmp_path)  # the README's short form: what differs from defaults
    assert short.returncode == 0, short.stderr[-2000:]
    assert "max_steps: 7" in short.stdout and "max_new_tokens: 6" in short.stdout
    assert "logprob_chunk_size" not in short.stdout and "clip_eps_low" not in short.stdout  # at their defaults
    assert len(short.stdout.splitlines()) < len(proc.stdout.splitlines()) / 2


@pytest.mark.parametrize(
    "override, needle",
    [(["--model.init_args.bogus_field", "3"], "bogus_field"),
     (["--model.init_args.clip_eps_low", "abc"], "clip_eps_low"),
     (["--data.init_args.group_size", "many"], "group_size")],
)
def test_bad_fields_fail_before_training_with_the_field_named(override, needle, tmp_path):
    proc = _cli("fit", "--config", str(REPO / "configs" / "grpo.yaml"), *override, cwd=tmp_path)
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing ran


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The lines of stderr that are not progress bars or Lightning's start-up chatter."""
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("rl-lightning: error") or "Traceback" in ln]


def test_bad_model_path_gives_one_clear_line(tmp_path):
    proc = _cli("fit", "--config", str(REPO / "configs" / "grpo.yaml"),
                "--model.init_args.model_name_or_path", str(tmp_path / "nope"), *TINY, cwd=tmp_path)
    assert proc.returncode == 2
    assert _error_lines(proc) == [
        f"rl-lightning: error in model (rl_lightning.algorithms.GRPO): model_name_or_path='{tmp_path / 'nope'}': "
        "no such directory; give the local directory of a Hugging Face checkpoint"
    ]


@pytest.mark.parametrize(
    "override, line",
    [(["--data.init_args.group_size", "-3"],  # checked when the data module is built
      "rl-lightning: error in data (rl_lightning.rollout.RolloutDataModule): RolloutDataModule: invalid "
      "data.init_args.group_size=-3"),
     (["--data.init_args.group_size", "1"],  # checked by the method at setup, inside Trainer.fit
      "rl-lightning: error: GRPO needs data.init_args.group_size >= 2 (its baseline compares the responses to one "
      "prompt), got 1")],
)
def test_bad_values_end_with_one_line_not_a_traceback(override, line, tmp_path):
    proc = _cli("fit", "--config", str(REPO / "configs" / "grpo.yaml"), *TINY, *override, cwd=tmp_path)
    assert proc.returncode == 2
    assert _error_lines(proc) == [line]


def test_the_full_traceback_on_request(tmp_path):
    env_proc = subprocess.run(
        [sys.executable, "-m", "rl_lightning", "fit", "--config", str(REPO / "configs" / "grpo.yaml"), *TINY,
         "--data.init_args.group_size", "-3"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO), "RL_LIGHTNING_TRACEBACK": "1"},
        capture_output=True, text=True, timeout=600)
    assert env_proc.returncode == 1
    assert "Traceback (most recent call last)" in env_proc.stderr
    assert "invalid data.init_args.group_size=-3" in env_proc.stderr


def test_short_fit_logs_the_fixed_metrics_and_resumes_from_last(tmp_path):
    proc = _cli("fit", "--config", str(REPO / "configs" / "grpo.yaml"), *TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log_dir = tmp_path / "runs" / "grpo" / "version_0"
    assert f"logs: {log_dir}" in proc.stdout + proc.stderr
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    for name in ("train/reward", "train/zero_std_fraction", "train/entropy", "train/sampler_logp_diff",
                 "train/grad_norm", "perf/step_time", "perf/tokens_per_sec", "val/reward"):
        assert name in scalars, name
    assert [e.step for e in acc.Scalars("val/reward")] == [0, 2]  # warm start, then after 2 steps
    assert "samples/train/text_summary" in acc.Tags()["tensors"]
    ckpt = log_dir / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()

    # --ckpt_path last continues the same run, in the same directory
    more = [a if a != "2" or i != 1 else "3" for i, a in enumerate(TINY)]  # max_steps 3
    proc = _cli("fit", "--config", str(REPO / "configs" / "grpo.yaml"), *more, "--ckpt_path", "last", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resuming the prompt stream at step 2" in proc.stdout + proc.stderr
    assert not (tmp_path / "runs" / "grpo" / "version_1").exists()
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/reward")] == [0, 1, 2]  # the curve continues, no step twice
    assert [e.step for e in acc.Scalars("val/reward")] == [0, 2, 3]  # no second step-0 one; the last step's

    # Resuming keeps the configuration's model settings (Lightning's default would replace them with the
    # checkpoint's) and says which differ; another method's checkpoint is refused.
    proc = _cli("fit", "--config", str(REPO / "configs" / "grpo.yaml"), *more, "--ckpt_path", str(ckpt),
                "--model", "rl_lightning.algorithms.RLOO", cwd=tmp_path)
    assert proc.returncode == 2
    assert _error_lines(proc) == [
        f"rl-lightning: error: --ckpt_path {ckpt} belongs to another run; it differs in model.class_path: "
        "'rl_lightning.algorithms.GRPO' in the checkpoint, 'rl_lightning.algorithms.RLOO' now; to resume that run "
        f"with its own configuration: --config {log_dir / 'config.yaml'} --ckpt_path {ckpt}"]
    more4 = [a if a != "2" or i != 1 else "4" for i, a in enumerate(TINY)]  # max_steps 4
    proc = _cli("fit", "--config", str(REPO / "configs" / "grpo.yaml"), *more4, "--ckpt_path", str(ckpt),
                "--model.init_args.clip_eps_high", "0.28", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "model.init_args.clip_eps_high: 0.2 in the checkpoint, 0.28 now" in proc.stderr
    assert "clip_eps_high: 0.28" in (log_dir / "config.resume-step3.yaml").read_text()
    assert "clip_eps_high: 0.2\n" in (log_dir / "config.yaml").read_text()  # the run's first config is kept


def test_the_documented_kl_command_line_trains_with_the_penalty(tmp_path, monkeypatch):
    from rl_lightning.callbacks import KLRegularizer

    monkeypatch.chdir(tmp_path)
    cli = build_cli(["fit", "--config", str(REPO / "configs" / "grpo.yaml"), *TINY,
                     "--trainer.callbacks+=KLRegularizer", "--trainer.callbacks.beta", "0.05"])
    kl = [cb for cb in cli.trainer.callbacks if isinstance(cb, KLRegularizer)]
    assert len(kl) == 1 and kl[0].beta == 0.05 and kl[0].reference is not None
    acc = EventAccumulator(str(tmp_path / "runs" / "grpo" / "version_0"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/kl_loss")] == [0, 1]
    assert acc.Scalars("train/kl_loss")[1].value > 0  # after one update the policy has left the reference


def test_the_last_step_is_evaluated_even_off_the_validation_interval(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    three = ["3" if i == 1 else a for i, a in enumerate(TINY)]  # max_steps 3, val_check_interval 2
    cli = build_cli(["fit", "--config", str(REPO / "configs" / "grpo.yaml"), *three,
                     "--trainer.logger.init_args.name", "three"])
    assert [s for s, _ in cli.model.val_history] == [0, 2, 3]
    acc = EventAccumulator(str(tmp_path / "runs" / "three" / "version_0"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("val/reward")] == [0, 2, 3]
    two = build_cli(["fit", "--config", str(REPO / "configs" / "grpo.yaml"), *TINY,
                     "--trainer.logger.init_args.name", "two"])
    assert [s for s, _ in two.model.val_history] == [0, 2]  # the interval's own evaluations are as before
    assert two.model.val_history == cli.model.val_history[:2]


def test_the_smollm2_config_before_its_checkpoint_is_built_says_how_to_build_it(tmp_path, monkeypatch, capsys):
    from rl_lightning.cli import cli_main

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cache/rl_lightning/SmolLM2-135M-Instruct here
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(REPO / "configs" / "grpo_smollm2.yaml")])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rl-lightning: error")]
    assert (exit_info.value.code, lines) == (2, [
        "rl-lightning: error in model (rl_lightning.algorithms.GRPO): "
        "model_name_or_path='~/.cache/rl_lightning/SmolLM2-135M-Instruct': no such directory; build it with "
        "`python experiments/smollm2.py`"])
    assert not (tmp_path / "runs").exists()


def test_the_readme_lists_every_scalar_a_grpo_run_logs(tmp_path, monkeypatch):
    import re

    text = (REPO / "README.md").read_text()
    start = text.index("a GRPO run (`configs/grpo.yaml`) logs")
    listed = text[start:start + re.search(r"With a KL\s+penalty on", text[start:]).start()]
    names = set()
    for name in re.findall(r"`((?:train|val|perf)/[a-z_]+(?:\([a-z_/]+\))?)`", listed):
        base, _, variants = name.partition("(")
        names |= {base, *(base + v for v in variants.rstrip(")").split("/") if variants)}
    monkeypatch.chdir(tmp_path)
    build_cli(["fit", "--config", str(REPO / "configs" / "grpo.yaml"), *TINY])
    acc = EventAccumulator(str(tmp_path / "runs" / "grpo" / "version_0"))
    acc.Reload()
    assert names == set(acc.Tags()["scalars"])


def test_the_private_names_compat_relies_on_still_exist(tmp_path):
    """``rl_lightning.callbacks.compat`` is the only user of Lightning's and jsonargparse's private API: after an
    upgrade, this names what is gone."""
    import inspect

    from jsonargparse import ArgumentParser
    from jsonargparse._parameter_resolvers import get_signature_parameters
    from lightning.pytorch import Trainer
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.loggers import TensorBoardLogger

    assert callable(Trainer(logger=False)._checkpoint_connector.dump_checkpoint)
    from lightning.pytorch.callbacks import ModelCheckpoint
    callback = ModelCheckpoint()
    for name in ("_should_skip_saving_checkpoint", "_monitor_candidates", "_save_topk_checkpoint",
                 "_save_last_checkpoint"):
        assert callable(getattr(callback, name)), name
    assert (callback._every_n_train_steps, callback._defer_save_until_validation) == (0, False)
    assert hasattr(callback, "_last_time_checked")
    assert isinstance(TensorBoardLogger(str(tmp_path))._kwargs, dict)
    assert callable(get_signature_parameters)
    assert list(inspect.signature(ArgumentParser._apply_actions).parameters)[:4] == [
        "self", "cfg", "parent_key", "prev_cfg"]
    assert "self._parse_ckpt_path()" in inspect.getsource(LightningCLI.__init__)


def test_validate_prints_its_result_and_writes_the_per_item_outcomes(tmp_path):
    """`rl-lightning validate` printed nothing before: now one line with the reward, the count, the split, the
    weights it evaluated and where the per-item outcomes are; the CSV holds one row per held-out prompt."""
    proc = _cli("validate", "--config", str(REPO / "configs" / "grpo.yaml"),
                "--data.init_args.evaluation.num_prompts", "12", "--trainer.logger.init_args.save_dir", str(tmp_path),
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("rl-lightning: val/reward")]
    assert len(line) == 1, proc.stderr[-3000:]
    assert "on 12 held-out prompts (test split, greedy) from the initial weights of embedded:arithmetic" in line[0]
    items = tmp_path / "grpo" / "version_0" / "eval_items.csv"
    assert f"per-item outcomes: {items.resolve()}" in line[0]
    rows = items.read_text().splitlines()
    assert rows[0] == "step,split,item,reward" and len(rows) == 13
    reward = float(line[0].split("val/reward ")[1].split()[0])
    assert reward == pytest.approx(sum(float(r.split(",")[3]) for r in rows[1:]) / 12, abs=5e-4)
