"""The contract every registered method keeps, checked on each one by being registered.

A method is registered when ``rl_lightning.algorithms`` exports it and ``configs/`` ships a config whose
``model.class_path`` names it. Each is checked by the public checker, ``rl_lightning.testing.check_method`` (learns
in 2 steps, resumes bit-identically from step 1, logs only documented scalars, and its inert-row claim holds), the
same function a researcher runs on an out-of-tree method; the checker itself is tested here on one that passes and
two that break it.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml

import rl_lightning.algorithms as algorithms
from rl_lightning.algorithms import RLModule
from rl_lightning.testing import ContractError, check_inert_rows, check_method
from tests.conftest import REPO

METHODS = sorted((getattr(algorithms, name) for name in algorithms.__all__
                  if inspect.isclass(getattr(algorithms, name)) and issubclass(getattr(algorithms, name), RLModule)
                  and getattr(algorithms, name) is not RLModule), key=lambda c: c.__name__)


def _configs() -> dict[str, Path]:
    found = {}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        model = (yaml.safe_load(path.read_text()) or {}).get("model", {})
        name = model.get("class_path", "").rsplit(".", 1)[-1]
        if name and model.get("init_args", {}).get("model_name_or_path", "embedded:arithmetic").startswith("embedded:"):
            found.setdefault(name, path)
    return found


CONFIGS = _configs()


def test_every_exported_method_is_registered_with_a_config():
    assert METHODS and {m.__name__ for m in METHODS} <= set(CONFIGS), sorted(
        {m.__name__ for m in METHODS} - set(CONFIGS))


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_a_method_learns_resumes_exactly_and_documents_what_it_logs(method, tmp_path):
    report = check_method(CONFIGS[method.__name__], workdir=tmp_path)
    assert report.method == method.__name__ and report.learns and report.resumes and report.documented
    assert report.inert_rows is (True if method.zero_advantage_rows_are_inert else None)


def test_the_checker_runs_on_an_out_of_tree_method_and_catches_a_broken_one(tmp_path, monkeypatch):
    """rl_lightning.testing.check_method on docs/examples' Dr. GRPO (a subclass outside the package) passes; a
    subclass that keeps state it does not checkpoint fails the resume check, one whose undocumented metric is not
    declared fails the metrics check, and declaring it passes."""
    monkeypatch.syspath_prepend(str(REPO / "docs" / "examples"))
    (tmp_path / "broken.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    report = check_method(REPO / "docs" / "examples" / "dr_grpo.yaml", workdir=tmp_path / "ok")
    assert report.method == "DrGRPO" and report.learns and report.resumes and report.documented
    grpo = REPO / "configs" / "grpo.yaml"
    with pytest.raises(ContractError, match="resuming from the step-1 checkpoint"):
        check_method(grpo, ["--model", "broken.Forgetful"], workdir=tmp_path / "forgetful")
    with pytest.raises(ContractError, match=r"not documented: \['train/my_count'\]"):
        check_method(grpo, ["--model", "broken.Chatty"], workdir=tmp_path / "chatty")
    assert check_method(grpo, ["--model", "broken.Chatty"], extra_metrics={"train/my_count"},
                        workdir=tmp_path / "chatty2").documented


BROKEN = '''
import torch
from rl_lightning.algorithms import GRPO


class Forgetful(GRPO):
    """Scales its advantages by a factor that grows each step and is never saved: a resume restarts it."""

    factor = 1.0

    def compute_advantages(self, batch):
        self.factor *= 3.0
        return super().compute_advantages(batch) * self.factor


class Chatty(GRPO):
    def rollout_metrics(self, batch):
        return {**super().rollout_metrics(batch), "train/my_count": torch.tensor(float(batch.num_rows))}
'''


@pytest.mark.parametrize("method", [m for m in METHODS if m.zero_advantage_rows_are_inert], ids=lambda m: m.__name__)
def test_a_method_that_declares_zero_advantage_rows_inert_gives_them_zero_loss_and_gradient(method):
    check_inert_rows(CONFIGS[method.__name__])


@pytest.mark.parametrize("config", ["dr_grpo.yaml", "dapo.yaml", "reinforce_pp_baseline.yaml"])
def test_methods_that_are_configurations_keep_the_contract_too(config, tmp_path):
    """Dr. GRPO and DAPO are GRPO configurations (DAPO with dynamic sampling and the overlong penalty, whose stream
    position must resume exactly), REINFORCE++-baseline a second config of ReinforcePP: each is checked as shipped."""
    report = check_method(REPO / "configs" / config, workdir=tmp_path)
    assert report.learns and report.resumes and report.documented


@pytest.mark.parametrize("config", ["grpo.yaml", "reinforce_pp.yaml"])
def test_lora_keeps_the_contract(config, tmp_path):
    """configs/presets/lora.yaml stacked on a method (GRPO; REINFORCE++, whose KL reference is then the base under
    the adapters): learns in 2 steps, resumes bit-identically from a checkpoint that holds the adapters only."""
    report = check_method(REPO / "configs" / config, ["--config", str(REPO / "configs" / "presets" / "lora.yaml")],
                          workdir=tmp_path)
    assert report.learns and report.resumes and report.documented
