"""The pieces of the vLLM engines that need no vLLM: the server guard (``rollout.serving``), the re-submitting
session (``sessions.ResubmitSession``) and the capabilities the engines declare.

The guard is tested with a stand-in server (Python's ``http.server``) started by a trainer stand-in in a
subprocess, which then ends in each way a run can end: normally, by an exception, by Ctrl-C (SIGINT) and by
SIGKILL. Each time the server's process must be gone soon after (the real vLLM server: tests/vllm).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rl_lightning.rollout import GroupRollout, Recording, RolloutDataModule, Sampling, VLLMEngine, VLLMServerEngine
from rl_lightning.rollout.engine import AUX_DRAWS, IN_PROCESS, SESSIONS, TOPK, SamplingParams
from rl_lightning.rollout.sessions import ResubmitSession
from tests.conftest import REPO

TRAINER = textwrap.dedent("""
    import importlib.util, os, signal, sys, time
    # A job started in the background by a non-interactive shell inherits SIGINT ignored, and Python then leaves it
    # ignored: the stand-in would sleep through the test's SIGINT. A trainer in a terminal has Python's handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    spec = importlib.util.spec_from_file_location("serving", sys.argv[3])  # the module alone: no torch to import
    serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serving)
    ServerProcess, free_port = serving.ServerProcess, serving.free_port
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                           f"http://127.0.0.1:{port}/", sys.argv[2], grace=5.0)
    server.wait_ready(60)
    print("SERVER", server.server_pid(), flush=True)
    how = sys.argv[1]
    if how == "exception":
        raise RuntimeError("a crash in training")
    if how in ("sigint", "sigkill"):
        time.sleep(120)  # the test signals this process
    server.stop() if how == "stop" else None
    """)


def _gone(pid: int, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["stop", "normal_exit", "exception", "sigint", "sigkill"])
def test_the_server_never_outlives_the_process_that_started_it(how, tmp_path):
    module = REPO / "rl_lightning" / "rollout" / "serving.py"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, how, str(tmp_path / "server.log"), str(module)],
                               cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = trainer.stdout.readline()
    assert line.startswith("SERVER "), (line, trainer.stderr.read() if trainer.poll() is not None else "")
    server_pid = int(line.split()[1])
    os.kill(server_pid, 0)  # running now
    if how == "sigint":
        trainer.send_signal(signal.SIGINT)
    elif how == "sigkill":
        trainer.kill()
    try:
        code = trainer.wait(timeout=60)
    except subprocess.TimeoutExpired:  # say where it hung
        trainer.kill()
        _, err = trainer.communicate()
        log = (tmp_path / "server.log").read_text() if (tmp_path / "server.log").exists() else ""
        pytest.fail(f"the trainer stand-in did not exit within 60 s after {how}; its stderr:\n{err[-2000:]}\n"
                    f"guard log:\n{log[-2000:]}")
    assert _gone(server_pid), f"server {server_pid} still running after the trainer's {how} (exit {code})"
    # an unhandled KeyboardInterrupt ends Python by SIGINT (-2), or exit code 1 where a handler turned it into one
    expected = {"stop": {0}, "normal_exit": {0}, "exception": {1}, "sigint": {1, -signal.SIGINT},
                "sigkill": {-signal.SIGKILL}}[how]
    assert code in expected


def test_a_server_that_dies_at_start_up_is_reported_with_its_log(tmp_path):
    from rl_lightning.rollout.serving import ServerProcess

    server = ServerProcess([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"],
                           "http://127.0.0.1:9/health", tmp_path / "server.log")
    with pytest.raises(RuntimeError, match="exited .* before it was ready(.|\n)*no model here"):
        server.wait_ready(30)


def _fake_complete(calls):
    """A stand-in engine: each turn samples ``budget`` ids counting up from the history's length."""

    def complete(histories, budgets, seeds):
        calls.append(([list(h) for h in histories], list(budgets), list(seeds)))
        return [([len(h) + k for k in range(b)], [-0.5] * b, "length", None) for h, b in zip(histories, budgets)]

    return complete


def test_a_resubmit_session_sends_each_rows_exact_history_and_applies_the_stop_check_afterwards():
    calls = []
    params = SamplingParams(max_tokens=4, eos_token_id=2, pad_token_id=0, seed=7)
    session = ResubmitSession(_fake_complete(calls), [[1, 5], [1, 6, 6]], params)
    first = session.turn([0, 1], [4, 3], stop=lambda row, ids: row == 0 and ids[-1] == 3)
    assert first.ids == [[2, 3], [3, 4, 5]] and first.finish_reasons == ["stop", "length"]
    assert first.logprobs == [[-0.5, -0.5], [-0.5, -0.5, -0.5]]
    session.append([1], [[9, 9]])  # row 0 ended; row 1 goes on with its observation
    second = session.turn([1], [2])
    assert calls[1][0] == [[1, 6, 6, 3, 4, 5, 9, 9]]  # prompt, its turn, its observation: nothing re-tokenised
    assert second.ids == [[8, 9]]
    seeds = [s for _, _, batch in calls for s in batch]
    assert len(set(seeds)) == 3  # one seed per row and turn ...
    again = []
    replay = ResubmitSession(_fake_complete(again), [[1, 5], [1, 6, 6]], params)
    replay.turn([0, 1], [4, 3])
    assert again[0][2] == calls[0][2]  # ... the same for the same params.seed


def test_the_vllm_engines_declare_sessions_and_topk_and_refuse_aux_draws_in_one_line():
    for engine in (VLLMEngine(), VLLMServerEngine()):
        assert engine.capabilities == {SESSIONS, TOPK}
        assert AUX_DRAWS not in engine.capabilities and IN_PROCESS not in engine.capabilities
    from rl_lightning.algorithms import GRPO
    from rl_lightning.envs import ArithmeticTask
    from tests.rollout.rollout_helpers import fake_trainer

    dm = RolloutDataModule(ArithmeticTask(num_heldout=4), prompts_per_step=2, group_size=2, engine=VLLMEngine(),
                           strategy=GroupRollout(max_turns=2), sampling=Sampling(max_new_tokens=4),
                           record=Recording(aux_draws=2))
    dm.trainer = fake_trainer(GRPO(model_name_or_path="embedded:random"))
    with pytest.raises(ValueError) as info:
        dm.setup("fit")
    message = str(info.value)
    assert "\n" not in message and message.startswith("VLLMEngine") and "record.aux_draws=2 needs 'aux_draws'" in \
        message


def test_topk_beyond_the_engines_max_logprobs_is_refused_naming_both():
    params = SamplingParams(max_tokens=4, eos_token_id=2, pad_token_id=0, topk=3)
    with pytest.raises(ValueError, match=r"topk=3 exceeds max_logprobs=1"):
        VLLMEngine(max_logprobs=1)._request(params, 1, 4, 0)
