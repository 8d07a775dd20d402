"""The metric names README.md's "Watching a run" lists are what a default run (configs/grpo.yaml) logs."""

from __future__ import annotations

import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rl_lightning.cli import build_cli
from tests.conftest import REPO

TINY = [
    "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
    "--data.init_args.task.init_args.num_heldout", "16", "--data.init_args.prompts_per_step", "4",
    "--data.init_args.group_size", "4", "--data.init_args.sampling.max_new_tokens", "4",
    "--data.init_args.evaluation.batch_size", "16", "--trainer.enable_progress_bar", "false",
]
_NAME = re.compile(r"(?:train|val|perf)/[a-z_]+(?:\((_[a-z]+(?:/_[a-z]+)*)\))?")


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def readme_metric_names() -> tuple[list[str], list[str]]:
    """``(names a default run logs, names only some settings log)`` from the README's scalars paragraph.

    The paragraph's first sentence lists what every default run logs; the sentences after it list what other
    settings add. ``train/clip_fraction(_low/_high)`` stands for three names.
    """
    section = _section((REPO / "README.md").read_text(), "Watching a run")
    paragraph = section[section.index("Scalars use fixed names"):].split("\n\n")[0]
    first, _, rest = paragraph.partition(". ")

    def names(text: str) -> list[str]:
        found = []
        for token in re.findall(r"`([^`]+)`", text):
            match = _NAME.fullmatch(token)
            if match is None:
                continue
            base = token.split("(")[0]
            found.append(base)
            found += [base + suffix for suffix in (match.group(1) or "").split("/") if suffix]
        return found

    return names(first), names(rest)


def test_the_readme_paragraph_lists_names():
    always, sometimes = readme_metric_names()
    assert {"train/reward", "train/clip_fraction", "train/clip_fraction_low", "train/clip_fraction_high",
            "train/lr", "val/reward", "perf/step_time"} <= set(always)
    assert "train/kl" in sometimes and "train/kl" not in always  # beta = 0 by default: no KL is logged


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> EventAccumulator:
    root = tmp_path_factory.mktemp("grpo")
    build_cli(["fit", "--config", str(REPO / "configs" / "grpo.yaml"), *TINY,
               f"--trainer.logger.init_args.save_dir={root}", f"--trainer.default_root_dir={root}"])
    (log_dir,) = (root / "grpo").glob("version_*")
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_every_listed_name_is_logged_by_a_default_run(default_run):
    scalars = set(default_run.Tags()["scalars"])
    always, sometimes = readme_metric_names()
    missing = [name for name in always if name not in scalars]
    assert not missing, f"README lists {missing}, which a default run does not log (it logs {sorted(scalars)})"
    # what the README says only other settings log is indeed absent by default (KL penalty off)
    assert not [name for name in sometimes if name in scalars and name not in always]
    assert [e.step for e in default_run.Scalars("val/reward")] == [0, 2]  # "logged at step 0 too"


def test_a_default_run_logs_no_hp_metric(default_run):
    assert "hp_metric" not in default_run.Tags()["scalars"]


def test_every_scalar_of_a_default_run_is_documented(default_run):
    documented = set(re.findall(r"`((?:train|val|perf)/[a-z_<>]+|epoch)`", (REPO / "docs" / "metrics.md").read_text()))
    documented |= {"train/clip_fraction_low", "train/clip_fraction_high"}  # "`train/clip_fraction`, `_low`, `_high`"
    undocumented = sorted(set(default_run.Tags()["scalars"]) - documented)
    assert not undocumented, f"docs/metrics.md does not describe {undocumented}"
