"""experiments/study.py and study_stats.py: the study protocol's statistics, config hashes, pinned setup and report,
on hand-computed numbers and hand-made runs; one slow end-to-end run that is stopped and resumed."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import study as S  # noqa: E402
from study_stats import mean_ci, paired_items, paired_seeds, verdict  # noqa: E402

from tests.conftest import REPO  # noqa: E402


# ============================================================================ statistics
def test_mean_ci_is_the_student_t_interval():
    ci = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    # sd = sqrt(2.5) = 1.5811; t(0.975, 4) = 2.776445; half = 2.776445 * 1.5811 / sqrt(5) = 1.963243
    assert ci.mean == 3.0 and ci.n == 5
    assert ci.high - ci.mean == pytest.approx(1.963243, abs=1e-6)
    assert ci.mean - ci.low == pytest.approx(1.963243, abs=1e-6)
    assert math.isnan(mean_ci([0.4]).low) and mean_ci([]).n == 0
    assert mean_ci([0.5, 0.5, 0.5]).low == 0.5  # no spread: zero width


def test_paired_seed_test_on_hand_numbers():
    method, base = {0: 0.5, 1: 0.6, 2: 0.7, 9: 1.0}, {0: 0.4, 1: 0.45, 2: 0.65, 3: 0.0}
    paired = paired_seeds(method, base)  # seeds 0-2 only: differences 0.1, 0.15, 0.05
    assert paired.diff.n == 3 and paired.diff.mean == pytest.approx(0.1)
    # t = 0.1 / (0.05 / sqrt 3) = 3.4641 with 2 degrees of freedom: p = 1 - t / sqrt(2 + t^2) = 0.074180
    assert paired.p == pytest.approx(1 - 3.4641016 / math.sqrt(2 + 12), abs=1e-6)
    assert verdict(paired) == "within noise"  # p > 0.05: the 95% interval holds 0
    clear = paired_seeds({0: 0.5, 1: 0.6, 2: 0.7}, {0: 0.3, 1: 0.41, 2: 0.49})  # differences 0.2, 0.19, 0.21
    assert verdict(clear) == "better" and clear.p < 0.01
    assert verdict(paired_seeds({0: 0.3, 1: 0.41, 2: 0.49}, {0: 0.5, 1: 0.6, 2: 0.7})) == "worse"
    assert verdict(paired_seeds({0: 0.5}, {0: 0.4})) == "too few seeds"
    same = paired_seeds({0: 0.5, 1: 0.6}, {0: 0.5, 1: 0.6})
    assert same.p == 1.0 and verdict(same) == "within noise"


def test_paired_items_drop_items_either_side_did_not_evaluate():
    paired = paired_items([1.0, 0.0, math.nan, 1.0, 1.0], [0.0, 0.0, 1.0, math.nan, 0.5])
    assert paired.diff.n == 3 and paired.diff.mean == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3


# ============================================================================ config hashes
def _config() -> dict:
    return {"seed_everything": 0, "ckpt_path": None,
            "trainer": {"max_steps": 10, "logger": {"init_args": {"save_dir": "runs", "name": "a", "version": None}}},
            "model": {"init_args": {"seed": 0, "lr": 1e-4}}, "data": {"init_args": {"seed": 0, "group_size": 8}}}


def test_config_hash_names_what_the_run_computes_and_nothing_else():
    base = S.config_hash(_config(), seed=3)
    moved = _config()
    moved["trainer"]["logger"]["init_args"].update(save_dir="/elsewhere", name="b", version="s3-x")
    moved["ckpt_path"] = "last"
    assert S.config_hash(moved, seed=3) == base  # where a run's files go is not what it computes
    assert S.config_hash(dict(reversed(list(_config().items()))), seed=3) == base  # key order
    assert S.config_hash(_config(), seed=4) != base
    changed = _config()
    changed["model"]["init_args"]["lr"] = 2e-4
    assert S.config_hash(changed, seed=3) != base
    changed = _config()
    changed["trainer"]["max_steps"] = 11
    assert S.config_hash(changed, seed=3) != base


# ============================================================================ the study file and the pinned setup
def _write_study(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"title": "T", "seeds": [0, 1, 2], "last_k": 2, "baseline": "a",
            "arms": {"a": {"configs": ["configs/grpo.yaml"]}, "b": {"configs": ["configs/reinforce.yaml"]}}}
    spec.update(fields)
    (folder / "study.yaml").write_text(yaml.safe_dump(spec))
    return folder


@pytest.mark.parametrize("fields, message", [
    ({"colour": "red"}, "unknown field 'colour'"),
    ({"arms": {"a": {"configs": ["configs/nope.yaml"]}}}, "no config file configs/nope.yaml"),
    ({"baseline": "c"}, "baseline 'c' is not an arm"),
    ({"split": "train"}, "split: 'train'"),
    ({"setup": {"kernel": "sse"}}, "setup.kernel"),
    ({"setup": {"venv": ".venv-nope"}}, "setup.venv: no .venv-nope/bin/rl-lightning"),
    ({"setup": {"colour": "red"}}, "setup: unknown field(s) colour"),
    ({"arms": {"a": {"configs": ["configs/grpo.yaml"], "task_after": []}}}, "arms.a: unknown field(s) task_after"),
])
def test_a_bad_study_file_is_refused_in_one_line(tmp_path, capsys, fields, message):
    folder = _write_study(tmp_path / "s", **fields)
    with pytest.raises(SystemExit) as err:
        S.load_study(folder)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "study.yaml" in lines[0]


def test_a_report_loads_a_study_whose_measured_config_was_removed_since(tmp_path, capsys):
    """``run`` and ``status`` need every arm's config files; a report reads only the exported CSVs."""
    folder = _write_study(tmp_path / "s", arms={"a": {"configs": ["configs/grpo.yaml"]},
                                               "b": {"configs": ["configs/tasks/removed_since.yaml"]}}, baseline="a")
    with pytest.raises(SystemExit):
        S.load_study(folder)
    assert "no config file configs/tasks/removed_since.yaml" in capsys.readouterr().err
    assert S.load_study(folder, check_configs=False).arms["b"].configs == ["configs/tasks/removed_since.yaml"]


def test_an_arms_stack_is_its_configs_then_the_study_task_then_its_after_configs(tmp_path):
    folder = _write_study(tmp_path / "s", task=["configs/tasks/calculator.yaml"], arms={
        "a": {"configs": ["configs/tempo.yaml"], "after": ["configs/tasks/calculator_tempo.yaml"]}}, baseline="a")
    assert S.load_study(folder).arms["a"].configs == [
        "configs/tempo.yaml", "configs/tasks/calculator.yaml", "configs/tasks/calculator_tempo.yaml"]


def test_a_study_refuses_another_kernel_set_or_thread_count(tmp_path, capsys):
    study = S.load_study(_write_study(tmp_path / "s"))
    setup = S.check_setup(study, allow_dirty=True)  # recorded on the first run
    assert setup["kernel"] == "avx2" and setup["threads"] == 1 and setup["pins"]["ATEN_CPU_CAPABILITY"] == "avx2"
    assert S.check_setup(study, allow_dirty=True) == setup  # the same setup: accepted
    study.kernel, study.threads = "avx512", 2
    with pytest.raises(SystemExit) as err:
        S.check_setup(study, allow_dirty=True)
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert "kernel=avx2" in message and "kernel=avx512" in message and "threads=1" in message


def test_a_kernel_set_the_cpu_lacks_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    study = S.load_study(_write_study(tmp_path / "s"))
    study.kernel = "avx512_bf16"
    monkeypatch.setattr(S, "cpu_flags", lambda: {"avx2", "avx512f"})
    with pytest.raises(SystemExit) as err:
        S.check_setup(study, allow_dirty=True)
    message = capsys.readouterr().err.strip()
    assert err.value.code == 2 and "\n" not in message
    assert message.startswith("study.py: setup.kernel: avx512_bf16 needs a CPU with avx512_bf16")
    assert not (study.folder / "setup.json").exists()  # nothing recorded
    monkeypatch.setattr(S, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    setup = S.check_setup(study, allow_dirty=True)
    pins = setup["pins"]
    assert pins["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16" and pins["ATEN_CPU_CAPABILITY"] == "avx512"


def test_run_with_seeds_runs_those_and_leaves_the_studys_seeds_to_the_report(tmp_path, monkeypatch):
    """``run --seeds 1`` runs seed 1 only; the report written after it still covers every seed of the study (it had
    covered seed 1 alone, and a run of one seed rewrote the study's README with that seed's runs)."""
    study = S.load_study(_write_study(tmp_path / "s"))
    ran = []
    monkeypatch.setattr(S, "check_setup", lambda *args: {"commit": "c" * 40, "cpu": "cpu"})
    monkeypatch.setattr(S, "is_exported", lambda *args: False)
    monkeypatch.setattr(S, "run_one", lambda study, arm, seed, digest, max_steps: ran.append((arm.name, seed)))
    monkeypatch.setattr(S, "export_run", lambda *args: None)
    S.command_run(study, ["a"], [1], restart=False)
    assert ran == [("a", 1)] and study.seeds == [0, 1, 2]
    assert [seed for _, seed, _, _ in S.plan(study, ["a"])] == [0, 1, 2]


def test_each_run_gets_the_pinned_environment():
    study = S.Study(Path("x"), "t", "test", [0], 3, "a", "avx2", 1, {})
    env = S.run_env(study)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == "AVX2" and env["OMP_NUM_THREADS"] == "1"


# ============================================================================ the report, from hand-made CSVs
def _export(folder: Path, arm: str, seed: int, val: dict[int, float], items: dict[int, list[float]],
            tokens: float, cpu: str | None = None) -> None:
    out = folder / "runs" / arm / f"seed{seed}"
    out.mkdir(parents=True)
    meta = {"arm": arm, "seed": seed, "hash": "h", "max_steps": 4, **({"cpu": cpu} if cpu else {})}
    (out / "run.json").write_text(json.dumps(meta))
    with open(out / "scalars.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "perf/optimizer_steps", "perf/sampled_tokens", "perf/step_time", "val/reward"])
        for step in range(5):
            train = [1, tokens, 0.5] if step < 4 else ["", "", ""]
            w.writerow([step, *train, val.get(step, "")])
    with open(out / "eval_items.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "split", "item", "reward"])
        for step, rewards in items.items():
            w.writerows([step, "test", i, r] for i, r in enumerate(rewards))


def test_report_headline_and_equal_compute_from_the_csvs(tmp_path):
    folder = _write_study(tmp_path / "s")
    (folder / "setup.json").write_text(json.dumps({
        "commit": "c" * 40, "trees": {"rl_lightning": "t" * 40, "configs": "u" * 40}, "kernel": "avx2",
        "pins": S.PINS["avx2"], "threads": 1, "cpu": "CPU", "cpu_avx512": False, "cpu_amx": False, "torch": "2",
        "python": "3"}))
    study = S.load_study(folder)
    a_last = {0: (0.5, 0.7), 1: (0.6, 0.6), 2: (0.4, 0.8)}  # last-2 means 0.6, 0.6, 0.6
    b_last = {0: (0.7, 0.9), 1: (0.8, 0.8), 2: (0.6, 1.0)}  # 0.8, 0.8, 0.8: +0.2 on every seed
    for arm, last, tokens in (("a", a_last, 100.0), ("b", b_last, 50.0)):
        for seed, (v2, v4) in last.items():
            _export(folder, arm, seed, {0: 0.2, 2: v2, 4: v4}, {0: [0.0, 1.0], 2: [v2, v2], 4: [v4, v4]}, tokens,
                    cpu="Other CPU" if (arm, seed) == ("b", 2) else "CPU" if seed else None)
    runs = S.load_study_runs(study)
    assert [r.last_k(2) for r in runs["a"]] == pytest.approx([0.6, 0.6, 0.6])
    rows = {row[0]: row for row in S.headline_rows(study, runs)}
    assert rows["a"][3] == "0.600 ± 0.000" and rows["a"][4] == "yes" and rows["a"][5] == "(baseline)"
    assert rows["b"][5] == "a: 0.200 ± 0.000" and rows["b"][8] == "better"
    header, compute = S.compute_rows(study, runs)
    # b samples 50 tokens a step, a 100: every run reached 200 tokens (b's 4 steps); a was there at step 2
    assert "at 200 sampled tokens" in header
    cells = {row[0]: row for row in compute}
    at_tokens = header.index("at 200 sampled tokens")
    assert cells["a"][at_tokens].startswith(f"{(0.5 + 0.6 + 0.4) / 3:.3f}")
    assert cells["b"][at_tokens].startswith(f"{(0.9 + 0.8 + 1.0) / 3:.3f}")  # b's last evaluation, step 4
    text = "\n".join(S.report_lines(study, runs, json.loads((folder / "setup.json").read_text()), None))
    assert "kernel set `avx2`" in text and "**test** split" in text and "Incomplete" not in text
    # a run exported on another CPU model is named (fp32 differs between CPU models even under the pins);
    # runs that did not record one (exported before run.json had it) are not
    assert "- **runs made on another CPU model** than CPU: b seed 2 (Other CPU)" in text.splitlines()


# ============================================================================ end to end (slow)
@pytest.mark.slow
def test_a_stopped_study_resumes_to_the_straight_runs_numbers(tmp_path):
    """A study of one arm: the run is stopped by SIGTERM to the runner mid-way, the rerun resumes it from its
    checkpoint, and its exported numbers equal those of a straight run of the same study elsewhere."""
    args = ["--trainer.max_steps", "12", "--trainer.val_check_interval", "4", "--data.init_args.prompts_per_step",
            "4", "--data.init_args.group_size", "4", "--data.init_args.task.init_args.num_validation", "32",
            "--data.init_args.evaluation.batch_size", "32"]
    spec = {"split": "validation", "seeds": [0], "last_k": 2,
            "arms": {"grpo": {"configs": ["configs/grpo.yaml"], "args": args}}}
    cmd = [sys.executable, str(REPO / "experiments" / "study.py"), "run", "--allow-dirty"]

    def study(name: str) -> tuple[Path, list[str]]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "study.yaml").write_text(yaml.safe_dump(spec))
        return folder, [*cmd, str(folder), "--runs-root", str(tmp_path / f"{name}_runs")]

    straight, straight_cmd = study("straight")
    subprocess.run(straight_cmd, check=True, capture_output=True, timeout=600)
    stopped, stopped_cmd = study("stopped")
    proc = subprocess.Popen(stopped_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = next((tmp_path / "stopped_runs").glob("stopped/grpo/*/fit.log"), None)
    deadline = time.time() + 300
    while time.time() < deadline and (log is None or "val/reward at step 0" not in log.read_text()):
        time.sleep(0.5)
        log = log or next((tmp_path / "stopped_runs").glob("stopped/grpo/*/fit.log"), None)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "rerun the same command to resume" in out
    run = log.parent
    assert (run / "checkpoints" / "last.ckpt").is_file() and not (run / "finished.json").exists()
    resumed = subprocess.run(stopped_cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    assert "resuming" in resumed
    for name in ("eval_items.csv",):
        assert (stopped / "runs/grpo/seed0" / name).read_text() == (straight / "runs/grpo/seed0" / name).read_text()
    columns = ("val/reward", "train/reward", "train/loss", "train/grad_norm")

    def numbers(folder: Path) -> list[tuple[str, ...]]:
        with open(folder / "runs/grpo/seed0/scalars.csv", newline="") as f:
            return [tuple(row[c] for c in ("step", *columns)) for row in csv.DictReader(f)]

    assert numbers(stopped) == numbers(straight)
    assert "Incomplete" not in (stopped / "README.md").read_text()


def test_the_setup_records_its_virtual_environment_and_refuses_another(tmp_path, capsys):
    """``setup.venv`` (default ``.venv``) is part of the pinned setup: the versions recorded are its interpreter's,
    a setup recorded before the field existed counts as ``.venv``, and another environment is refused."""
    import lightning

    study = S.load_study(_write_study(tmp_path / "s"))
    assert study.venv == ".venv" and study.bin == S.REPO / ".venv" / "bin"
    setup = S.check_setup(study, allow_dirty=True)
    assert setup["venv"] == ".venv" and setup["packages"]["torch"] == torch.__version__
    assert setup["packages"]["lightning"] == lightning.__version__ and setup["torch"] == torch.__version__
    older = {k: v for k, v in setup.items() if k not in ("venv", "packages")}  # a setup.json of an earlier study
    (study.folder / "setup.json").write_text(json.dumps(older))
    assert S.check_setup(study, allow_dirty=True) == {**older, "venv": ".venv"}
    (tmp_path / "other").symlink_to(S.REPO / ".venv")  # the same interpreter under another name
    study.venv = str(tmp_path / "other")
    with pytest.raises(SystemExit) as err:
        S.check_setup(study, allow_dirty=True)
    message = capsys.readouterr().err
    assert err.value.code == 2 and f"venv=.venv; this run would use venv={tmp_path / 'other'}" in message
    line = S._versions_line({**setup, "venv": ".venv-vllm", "packages": {"torch": "2.13.0", "vllm": "0.32.0"}})
    assert line == "torch 2.13.0, vllm 0.32.0, Python " + setup["python"] + "; every run in `.venv-vllm`"
    assert S._versions_line(older) == f"torch {torch.__version__}, Python {setup['python']}"
