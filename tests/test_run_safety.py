"""Run safety: one directory per run, resume only the run named, checkpoints on interrupt, atomic writes,
replayable failures, and one line for every bad checkpoint."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.plugins.io import TorchCheckpointIO
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rl_lightning.callbacks.safety import AtomicCheckpointIO
from rl_lightning.cli import build_cli, cli_main
from rl_lightning.envs import ArithmeticTask
from rl_lightning.replay import replay
from tests.conftest import REPO

GRPO = str(REPO / "configs" / "grpo.yaml")


def tiny(max_steps: int, val_every: int = 2) -> list[str]:
    return ["--trainer.max_steps", str(max_steps), "--trainer.val_check_interval", str(val_every),
            "--data.init_args.task.init_args.num_heldout", "16", "--data.init_args.prompts_per_step", "4",
            "--data.init_args.group_size", "4", "--data.init_args.sampling.max_new_tokens", "4",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def fit(*args: str):
    return build_cli(["fit", "--config", GRPO, *args])


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def one_line_error(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(list(args))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rl-lightning: error")]
    assert len(lines) == 1, lines
    return exit_info.value.code, lines[0]


def test_last_resumes_the_named_run_into_its_own_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fit(*tiny(4))
    grpo = tmp_path / "runs" / "grpo" / "version_0"
    assert (grpo / "checkpoints" / "last.ckpt").is_file() and (grpo / "config.yaml").is_file()
    assert (yaml.safe_load((grpo / "config.yaml").read_text())["trainer"]["logger"]["init_args"]["version"]
            == "version_0")
    # another run, under another logger name (the reproduction: a JSONL subtraction task)
    data = tmp_path / "sub.jsonl"
    data.write_text("".join(f'{{"prompt": "{a}-{b}=", "answer": "{a - b}"}}\n' for a in range(5, 10) for b in range(5)))
    build_cli(["fit", "--config", GRPO, *tiny(3), "--data.init_args.task", "rl_lightning.envs.JsonlTask",
               "--data.init_args.task.init_args.train_file", str(data), "--data.init_args.task.init_args.num_heldout",
               "4", "--trainer.logger.init_args.name", "sub"])
    sub = tmp_path / "runs" / "sub" / "version_0"
    assert (sub / "checkpoints" / "last.ckpt").is_file()

    cli = fit(*tiny(6), "--ckpt_path", "last")  # the grpo run, not the newer subtraction run
    assert cli.trainer.global_step == 6
    assert cli.datamodule.cursor == 6
    assert not (tmp_path / "runs" / "grpo" / "version_1").exists()
    assert [s for s, _ in scalars(grpo, "train/reward")] == [0, 1, 2, 3, 4, 5]
    assert (grpo / "config.resume-step4.yaml").is_file()

    # the subtraction run's checkpoint is refused with the differing fields, in one line
    code, line = one_line_error(capsys, "fit", "--config", GRPO, *tiny(6), "--ckpt_path", str(sub))
    assert code == 2
    assert line == (f"rl-lightning: error: --ckpt_path {sub / 'checkpoints' / 'last.ckpt'} belongs to another run; "
                    "it differs in data.init_args.task.class_path: 'rl_lightning.envs.JsonlTask' in the checkpoint, "
                    "'rl_lightning.envs.ArithmeticTask' now; to resume that run with its own configuration: "
                    f"--config {sub / 'config.yaml'} --ckpt_path {sub}")
    code, line = one_line_error(capsys, "fit", "--config", GRPO, *tiny(6), "--ckpt_path", "last",
                                "--data.init_args.task.init_args.num_digits", "3")
    assert code == 2 and "data.init_args.task.init_args.num_digits: 2 in the checkpoint, 3 now" in line


def test_last_of_another_task_is_refused_with_the_command_that_resumes_this_ones_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fit(*tiny(2))  # runs/grpo/version_0: 2-digit addition
    fit(*tiny(2), "--data.init_args.task.init_args.num_digits", "3")  # runs/grpo/version_1: another task, newer
    code, line = one_line_error(capsys, "fit", "--config", GRPO, *tiny(3), "--ckpt_path", "last")
    assert code == 2
    assert line == ("rl-lightning: error: --ckpt_path runs/grpo/version_1/checkpoints/last.ckpt belongs to another "
                    "run; it differs in data.init_args.task.init_args.num_digits: 3 in the checkpoint, 2 now; to "
                    "resume the newest run of this configuration: --config runs/grpo/version_0/config.yaml "
                    "--ckpt_path last")
    cli = build_cli(["fit", "--config", "runs/grpo/version_0/config.yaml", *tiny(3), "--ckpt_path", "last"])
    assert cli.trainer.global_step == 3 and cli.trainer.log_dir == "runs/grpo/version_0"
    shutil.rmtree(tmp_path / "runs" / "grpo" / "version_0")  # no run of this configuration left
    code, line = one_line_error(capsys, "fit", "--config", GRPO, *tiny(3), "--ckpt_path", "last")
    other = tmp_path / "runs" / "grpo" / "version_1"
    assert code == 2 and line.endswith(f"2 now; to resume that run with its own configuration: --config "
                                       f"{other / 'config.yaml'} --ckpt_path last; or start a new run without "
                                       "--ckpt_path")


def test_a_run_that_trains_nothing_leaves_no_run_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, line = one_line_error(capsys, "fit", "--config", GRPO, *tiny(2), "--data.init_args.group_size", "1")
    assert code == 2 and "GRPO needs data.init_args.group_size >= 2" in line  # refused in the method's setup
    assert not (tmp_path / "runs").exists()
    proc = _cli_process(["fit", "--config", GRPO, *tiny(0)], tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = [ln for ln in err.splitlines() if ln.startswith("rl-lightning: 0 steps")]
    assert len(summary) == 1 and summary[0].endswith("nothing was trained or logged, so no run directory is kept")
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs" / "grpo" / "version_0").mkdir(parents=True)  # another run's: kept
    (tmp_path / "runs" / "grpo" / "version_0" / "notes.txt").write_text("mine")
    code, line = one_line_error(capsys, "fit", "--config", GRPO, *tiny(2), "--data.init_args.group_size", "1")
    assert sorted(p.name for p in (tmp_path / "runs" / "grpo").iterdir()) == ["version_0"]


def test_the_summary_names_a_checkpoints_directory_only_when_there_is_one(tmp_path):
    proc = _cli_process(["fit", "--config", GRPO, *tiny(2), "--trainer.enable_checkpointing", "false",
                         "--trainer.callbacks", "[]"], tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = [ln for ln in err.splitlines() if ln.startswith("rl-lightning: val/reward")]
    assert len(summary) == 1 and "; 2 steps in " in summary[0] and "checkpoints:" not in summary[0]


def test_a_resumed_runs_summary_counts_only_the_steps_it_ran(tmp_path):
    proc = _cli_process(["fit", "--config", GRPO, *tiny(2)], tmp_path)
    assert proc.wait(timeout=300) == 0
    proc = _cli_process(["fit", "--config", GRPO, *tiny(3), "--ckpt_path", "last"], tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = [ln for ln in err.splitlines() if ln.startswith("rl-lightning: val/reward")]
    assert len(summary) == 1 and "; 1 step in " in summary[0] and "(resumed at step 2); checkpoints: " in summary[0]


def test_resuming_an_earlier_checkpoint_continues_the_curves_without_overlap(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fit(*tiny(4))
    run = tmp_path / "runs" / "grpo" / "version_0"
    shutil.copy(run / "checkpoints" / "last.ckpt", run / "checkpoints" / "step4.ckpt")
    fit(*tiny(6), "--ckpt_path", "last")
    first = scalars(run, "train/reward")
    val_first = scalars(run, "val/reward")
    fit(*tiny(6), "--ckpt_path", str(run / "checkpoints" / "step4.ckpt"))  # steps 4, 5 again
    again = scalars(run, "train/reward")
    assert [s for s, _ in again] == [0, 1, 2, 3, 4, 5]  # each step once: the first resume's 4, 5 are purged
    assert again == first  # and the rerun is exact
    assert scalars(run, "val/reward") == val_first


def test_a_fresh_run_never_writes_into_a_run_that_has_checkpoints(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fit(*tiny(2))
    config = tmp_path / "runs" / "grpo" / "version_0" / "config.yaml"
    code, line = one_line_error(capsys, "fit", "--config", str(config), *tiny(2))  # its version is pinned
    assert code == 2 and "already holds a run with checkpoints" in line and "--ckpt_path last" in line
    cli = build_cli(["fit", "--config", str(config), *tiny(3), "--ckpt_path", "last"])  # resuming it is fine
    assert cli.trainer.global_step == 3


def test_bad_checkpoints_give_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fit(*tiny(2))
    good = tmp_path / "runs" / "grpo" / "version_0" / "checkpoints" / "last.ckpt"
    empty, truncated = tmp_path / "empty.ckpt", tmp_path / "truncated.ckpt"
    empty.write_bytes(b"")
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    code, line = one_line_error(capsys, "fit", "--config", GRPO, *tiny(3), "--ckpt_path", str(empty))
    assert code == 2 and line == (f"rl-lightning: error: --ckpt_path {empty}: the file is empty "
                                  "(a write that was interrupted?)")
    code, line = one_line_error(capsys, "fit", "--config", GRPO, *tiny(3), "--ckpt_path", str(truncated))
    assert code == 2 and line.startswith(f"rl-lightning: error: --ckpt_path {truncated}: not a readable checkpoint")
    code, line = one_line_error(capsys, "fit", "--config", GRPO, *tiny(3), "--ckpt_path", str(tmp_path / "nope.ckpt"))
    assert code == 2 and line.endswith("nope.ckpt: no such file")
    # same run identity, another architecture (the model directory changed under the run)
    state = torch.load(good, weights_only=False)
    key = next(k for k in state["state_dict"] if k.endswith("embed_tokens.weight"))
    state["state_dict"][key] = torch.zeros(7, 3)
    other = tmp_path / "other.ckpt"
    torch.save(state, other)
    code, line = one_line_error(capsys, "fit", "--config", GRPO, *tiny(3), "--ckpt_path", str(other))
    assert code == 2 and "holds another architecture" in line and f"{key} [7, 3] in the checkpoint" in line


def test_atomic_checkpoint_writes_leave_the_previous_file_when_killed(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, target)
    before = target.read_bytes()

    def killed_half_way(obj, handle, *args, **kwargs):
        handle.write(b"partial bytes")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 2}, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


@pytest.mark.parametrize("io_class, intact", [(AtomicCheckpointIO, True), (TorchCheckpointIO, False)],
                         ids=["AtomicCheckpointIO", "lightning-TorchCheckpointIO"])
def test_a_write_killed_when_the_temp_dir_is_on_another_file_system(tmp_path, monkeypatch, io_class, intact):
    """Why ``AtomicCheckpointIO`` stays: Lightning's write goes through a file in the system temp directory that
    ``shutil.move`` puts in place; across file systems (``os.rename`` fails with EXDEV) that is a copy into the
    checkpoint itself, and a kill during the copy leaves it truncated. Ours renames within the target's directory.
    (Should Lightning's come out intact here after an upgrade, drop ours.)"""
    target = tmp_path / "run" / "last.ckpt"
    io_class().save_checkpoint({"state_dict": {"w": torch.ones(1000)}, "global_step": 1}, target)
    sendfile = os.sendfile

    def other_file_system(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))

    def killed_half_way(out_fd, in_fd, offset, count):
        sendfile(out_fd, in_fd, offset, 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", other_file_system)
    monkeypatch.setattr(os, "sendfile", killed_half_way)
    try:  # ours never copies, so nothing kills it here: it writes the new checkpoint
        io_class().save_checkpoint({"state_dict": {"w": torch.zeros(1000)}, "global_step": 2}, target)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    try:
        step = torch.load(target, weights_only=True)["global_step"]
    except RuntimeError:  # "PytorchStreamReader failed reading zip archive": truncated
        step = None
    assert (step in (1, 2)) is intact, step


# ------------------------------------------------------------------------------------------- interrupts
def _cli_process(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "rl_lightning", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _logged_steps(run: Path) -> int:
    if not run.is_dir():
        return 0
    try:
        return len(scalars(run, "train/reward"))
    except KeyError:  # nothing logged yet
        return 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_saves_its_last_step_and_resumes_exactly(tmp_path, signum):
    steps = ["--trainer.max_steps", "14", "--trainer.val_check_interval", "5",
             "--data.init_args.task.init_args.num_heldout", "16", "--data.init_args.prompts_per_step", "4",
             "--data.init_args.group_size", "4", "--data.init_args.sampling.max_new_tokens", "4"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    straight.mkdir(), cut.mkdir()
    proc = _cli_process(["fit", "--config", GRPO, *steps], straight)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]

    proc = _cli_process(["fit", "--config", GRPO, *steps], cut)
    run = cut / "runs" / "grpo" / "version_0"
    deadline = time.time() + 300
    while _logged_steps(run) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, err[-3000:]
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    stopped_at = saved["global_step"]
    assert 3 <= stopped_at < 14
    # the step index of the logs: "finishing step k", then "after step k" (k + 1 steps done, resumed at k + 1)
    assert f"received {signal.Signals(signum).name}: finishing step {stopped_at - 1}, then writing" in out
    assert f"rl-lightning: stopped by {signal.Signals(signum).name} after step {stopped_at - 1}; checkpoint: " in err
    assert _logged_steps(run) == stopped_at  # the checkpoint holds every step that was logged

    proc = _cli_process(["fit", "--config", GRPO, *steps, "--ckpt_path", "last"], cut)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    a = torch.load(straight / "runs" / "grpo" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert a["global_step"] == b["global_step"] == 14
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    assert scalars(run, "train/reward") == scalars(straight / "runs" / "grpo" / "version_0", "train/reward")
    assert scalars(run, "val/reward") == scalars(straight / "runs" / "grpo" / "version_0", "val/reward")


def test_a_second_interrupt_stops_at_once_with_status_130_and_one_line(tmp_path):
    layer = tmp_path / "slow.yaml"
    layer.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "tests.helpers.failing.SlowSteps", "init_args": {"step": 3, "seconds": 30.0}},
        {"class_path": "rl_lightning.callbacks.StepCheckpoint", "init_args": {"every_n_train_steps": 1}}]}}))
    proc = _cli_process(["fit", "--config", GRPO, "--config", str(layer), *tiny(10, val_every=10)], tmp_path)
    run = tmp_path / "runs" / "grpo" / "version_0"
    deadline = time.time() + 300
    while _logged_steps(run) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # inside step 3's sleep
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "received SIGINT: finishing step 3, then writing a checkpoint" in out
    last = run / "checkpoints" / "last.ckpt"
    assert "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.startswith("rl-lightning: stopped")] == [
        "rl-lightning: stopped at once by a second SIGINT in step 3; the last checkpoint is "
        "runs/grpo/version_0/checkpoints/last.ckpt; resume with --ckpt_path last"]
    assert torch.load(last, weights_only=False)["global_step"] == 3  # steps 0-2, written before step 3
    assert not (run / "failures").exists()  # an interrupt is not a failure


# ------------------------------------------------------------------------------------------- failures
def _failing_config(tmp_path: Path, extra_callback: dict | None = None, reward: dict | None = None) -> Path:
    callbacks = [
        {"class_path": "rl_lightning.callbacks.KLRegularizer", "init_args": {"beta": 0.0}},
        {"class_path": "rl_lightning.callbacks.StepCheckpoint",
         "init_args": {"every_n_train_steps": 1, "save_last": True, "save_top_k": -1}},
    ]
    if extra_callback:
        callbacks.append(extra_callback)
    layer: dict = {"trainer": {"callbacks": callbacks}}
    if reward:
        layer["data"] = {"init_args": {"reward_fn": reward}}
    path = tmp_path / "failing.yaml"
    path.write_text(yaml.safe_dump(layer))
    return path


@pytest.mark.parametrize("minibatches, call", [(1, 0), (2, 1)], ids=["first-optimizer-step", "after-an-inner-step"])
def test_a_non_finite_step_is_dumped_and_replays_exactly(tmp_path, monkeypatch, capsys, minibatches, call):
    monkeypatch.chdir(tmp_path)
    layer = _failing_config(tmp_path, {"class_path": "tests.helpers.failing.NonFiniteAtStep",
                                       "init_args": {"step": 2, "call": call}})
    args = ["fit", "--config", GRPO, "--config", str(layer), *tiny(5, val_every=10),
            "--model.init_args.num_minibatches", str(minibatches)]
    code, line = one_line_error(capsys, *args)
    run = tmp_path / "runs" / "grpo" / "version_0"
    failure = run / "failures" / "step_000002"
    assert code == 1
    assert line.startswith("rl-lightning: error: NonFiniteLossError: non-finite loss (nan) at step 2")
    assert f"rl-lightning replay {failure}" in line
    # the last good checkpoint is intact: the state after step 2's predecessor
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 2
    state = torch.load(failure / "state.ckpt", weights_only=False)
    assert state["global_step"] == 2
    for key, value in last["state_dict"].items():  # the dump holds the weights at the start of the failed step
        assert torch.equal(value, state["state_dict"][key]), key
    assert any(k.startswith("RolloutDataModule") and v["cursor"] == 2 for k, v in state.items() if isinstance(v, dict))
    dump = torch.load(failure / "batch.pt", weights_only=False)
    assert dump["where"] == "update" and dump["optimizer_steps_before_failure"] == call
    import warnings

    with warnings.catch_warnings(record=True) as caught, pytest.raises(FloatingPointError, match="non-finite loss"):
        warnings.simplefilter("always")
        replay(failure, build_cli)
    assert not (tmp_path / "checkpoints").exists()  # replay writes nothing
    # the callbacks replay leaves out on purpose are not asked for (no filter hides Lightning's notice)
    assert [str(w.message) for w in caught if "callbacks used to create" in str(w.message)] == []
    # the state dump also resumes: the run continues from the failed step once the cause is gone
    cli = build_cli(["fit", "--config", GRPO, *tiny(4, val_every=10), "--ckpt_path", str(failure / "state.ckpt")])
    assert cli.trainer.global_step == 4


def test_a_reward_function_that_raises_is_dumped_with_its_responses(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    task = ArithmeticTask(num_digits=2, operations=["+"], num_heldout=16, seed=1234)  # as configs/grpo.yaml, tiny()
    poison = task.train_prompt(2 * 4 + 1).text  # the second prompt of step 2
    assert poison not in [task.train_prompt(i).text for i in range(8)]
    layer = _failing_config(tmp_path, reward={"class_path": "tests.helpers.failing.PoisonedReward",
                                              "init_args": {"poison": [poison]}})
    code, line = one_line_error(capsys, "fit", "--config", GRPO, "--config", str(layer), *tiny(5, val_every=10))
    failure = tmp_path / "runs" / "grpo" / "version_0" / "failures" / "step_000002"
    assert code == 1
    assert line.startswith("rl-lightning: error: RewardError at step 2: reward function PoisonedReward raised "
                           f"ValueError: cannot score {poison!r}")
    dump = torch.load(failure / "batch.pt", weights_only=False)
    assert dump["where"] == "rollout"
    assert [p.text for p in dump["batch"].prompts].index(poison) == 4  # group 1 of 4 responses each
    assert torch.isnan(dump["batch"].rewards[4:]).all() and not torch.isnan(dump["batch"].rewards[:4]).any()
    with pytest.raises(Exception, match="cannot score"):
        replay(failure, build_cli)


def test_a_reward_function_that_raises_in_the_step_0_evaluation_is_dumped_with_its_responses(tmp_path, monkeypatch,
                                                                                          capsys):
    """The evaluation before any update scores the held-out prompts; a reward that raises there is dumped to
    failures/eval_step_000000 with the evaluation's responses, the one-line error names it, and replay scores them
    again (it was not dumped at all: no training step had started)."""
    monkeypatch.chdir(tmp_path)
    task = ArithmeticTask(num_digits=2, operations=["+"], num_heldout=16, seed=1234)
    poison = task.heldout_prompts()[3].text
    layer = _failing_config(tmp_path, reward={"class_path": "tests.helpers.failing.PoisonedReward",
                                              "init_args": {"poison": [poison]}})
    code, line = one_line_error(capsys, "fit", "--config", GRPO, "--config", str(layer), *tiny(4, val_every=2))
    failure = tmp_path / "runs" / "grpo" / "version_0" / "failures" / "eval_step_000000"
    assert code == 1
    assert line.startswith("rl-lightning: error: RewardError at step 0: reward function PoisonedReward raised")
    assert f"rl-lightning replay {failure}" in line
    dump = torch.load(failure / "batch.pt", weights_only=False)
    assert dump["where"] == "evaluation" and not (failure / "state.ckpt").exists()
    assert poison in [p.text for p in dump["batch"].prompts] and dump["batch"].group_size == 1
    with pytest.raises(Exception, match="cannot score"):
        replay(failure, build_cli)


def test_failure_snapshots_do_not_log_a_line_every_step(tmp_path, monkeypatch):
    """Lightning's ``dump_checkpoint`` without ``weights_only`` logs "`weights_only` was not set" each call (once
    a step for methods with several optimiser steps), which also broke the progress bar into stale lines."""
    monkeypatch.chdir(tmp_path)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector")
    logger.addHandler(handler)
    try:
        fit(*tiny(3, val_every=10), "--model.init_args.num_minibatches", "2")  # a snapshot after every step
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if "weights_only" in r.getMessage()] == []


@pytest.mark.parametrize("final", [False, True])
def test_a_run_ending_between_two_periodic_saves_gets_the_last_checkpoint_of_its_final_step(tmp_path, final):
    """StepCheckpoint (every_n_train_steps=2, save_last), as Lightning's ModelCheckpoint, leaves the last.ckpt of
    step 2 after a run of 3 steps; FinalCheckpoint (which the CLI adds to every run) writes the one of step 3."""
    from rl_lightning.algorithms import GRPO
    from rl_lightning.callbacks import FinalCheckpoint, StepCheckpoint
    from tests.conftest import tiny_datamodule, tiny_trainer

    checkpoints = StepCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True, save_top_k=-1)
    trainer = tiny_trainer(tmp_path, max_steps=3, enable_checkpointing=True,
                           callbacks=([FinalCheckpoint()] if final else []) + [checkpoints])
    trainer.fit(GRPO(model_name_or_path="embedded:random"), datamodule=tiny_datamodule())
    step = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]
    assert step == (3 if final else 2)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]


def test_final_checkpoint_writes_nothing_more_when_the_last_save_was_the_final_step(tmp_path):
    from rl_lightning.algorithms import GRPO
    from rl_lightning.callbacks import FinalCheckpoint, StepCheckpoint
    from tests.conftest import tiny_datamodule, tiny_trainer

    trainer = tiny_trainer(tmp_path, max_steps=2, enable_checkpointing=True,
                           callbacks=[FinalCheckpoint(),
                                      StepCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2,
                                                      save_last=True, save_top_k=-1)])
    saved: list[tuple[str, int]] = []
    save = trainer.save_checkpoint

    def counted(filepath, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        saved.append((Path(filepath).name, trainer.global_step))
        return save(filepath, *args, **kwargs)

    trainer.save_checkpoint = counted  # every write, StepCheckpoint's and FinalCheckpoint's, goes through it
    trainer.fit(GRPO(model_name_or_path="embedded:random"), datamodule=tiny_datamodule())
    assert saved == [("epoch=0-step=2.ckpt", 2), ("last.ckpt", 2)]  # once each, at step 2


def test_weights_only_checkpoints_hold_the_weights_and_no_optimiser_state(tmp_path):
    """The documented setting for short experiments (docs/real_models.md#checkpoints): StepCheckpoint's
    save_weights_only; the run's final last.ckpt (FinalCheckpoint) is weights-only too."""
    from rl_lightning.algorithms import GRPO
    from rl_lightning.callbacks import FinalCheckpoint, StepCheckpoint
    from tests.conftest import tiny_datamodule, tiny_trainer

    def run(weights_only: bool) -> dict:
        root = tmp_path / str(weights_only)
        checkpoint = StepCheckpoint(dirpath=root, every_n_train_steps=2, save_last=True, save_top_k=-1,
                                     save_weights_only=weights_only)
        module = GRPO(model_name_or_path="embedded:arithmetic")
        tiny_trainer(root, max_steps=3, callbacks=[checkpoint, FinalCheckpoint()], enable_checkpointing=True).fit(
            module, datamodule=tiny_datamodule())
        saved = torch.load(root / "last.ckpt", weights_only=False)
        assert saved["global_step"] == 3  # FinalCheckpoint's, after the step-2 save
        for key, value in module.state_dict().items():
            assert torch.equal(saved["state_dict"][key], value), key
        return saved

    assert "optimizer_states" in run(False)
    light = run(True)
    assert "optimizer_states" not in light and "lr_schedulers" not in light


def test_step_checkpoint_saves_what_model_checkpoint_saves_without_its_manual_optimisation_notice(tmp_path):
    """The shipped configs' StepCheckpoint writes the same files at the same steps, with the same weights, as
    Lightning's ModelCheckpoint; only ModelCheckpoint warns that they hold the post-update state."""
    import warnings

    from lightning.pytorch.callbacks import ModelCheckpoint

    from rl_lightning.algorithms import GRPO
    from rl_lightning.callbacks import StepCheckpoint
    from tests.conftest import tiny_datamodule, tiny_trainer

    def run(kind: type) -> tuple[dict, list[str]]:
        root = tmp_path / kind.__name__
        checkpoint = kind(dirpath=root, every_n_train_steps=2, save_last=True, save_top_k=-1)
        trainer = tiny_trainer(root, max_steps=4, callbacks=[checkpoint], enable_checkpointing=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(GRPO(model_name_or_path="embedded:random"), datamodule=tiny_datamodule())
        files = {p.name: torch.load(p, map_location="cpu", weights_only=False) for p in root.glob("*.ckpt")}
        return files, [str(w.message) for w in caught if "manual optimization" in str(w.message)]

    lightning_files, lightning_notices = run(ModelCheckpoint)
    step_files, step_notices = run(StepCheckpoint)
    assert len(lightning_notices) >= 1 and step_notices == []
    assert sorted(step_files) == sorted(lightning_files) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt",
                                                              "last.ckpt"]
    for name, saved in step_files.items():
        assert saved["global_step"] == lightning_files[name]["global_step"]
        for key, value in saved["state_dict"].items():
            assert torch.equal(value, lightning_files[name]["state_dict"][key]), (name, key)
