"""``rl-lightning generate``: k scored samples per prompt to JSONL, with mean@k and pass@k; greedy responses that are
the held-out evaluation's; prompts from a file, answered or not; errors in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rl_lightning.cli import build_cli, cli_main
from rl_lightning.envs import ExactMatchReward, Prompt
from rl_lightning.functional import pass_at_k
from rl_lightning.rollout import Evaluation
from tests.conftest import REPO

GRPO = str(REPO / "configs" / "grpo.yaml")


def _generate(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        cli_main(["generate", *args])
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    cli_main(["fit", "--config", GRPO, "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
              "--trainer.enable_progress_bar=false", "--data.init_args.sampling.max_new_tokens=4",
              f"--trainer.logger.init_args.save_dir={root}"])
    (path,) = root.glob("grpo/version_*")
    return path


def test_samples_are_scored_and_summarised_as_pass_at_k(run, tmp_path, capsys):
    code, out, _ = _generate(capsys, str(run), "--out", str(tmp_path / "s.jsonl"), "--n", "4", "--k", "1", "2", "4",
                             "--limit", "12")
    assert code == 0
    lines = _lines(tmp_path / "s.jsonl")
    assert len(lines) == 48 and [s["sample"] for s in lines[:4]] == [0, 1, 2, 3]
    reward = ExactMatchReward()
    assert all(s["reward"] == reward(Prompt(s["prompt"], s["answer"]), s["response"]) for s in lines)
    per_prompt = [[s["reward"] for s in lines[i:i + 4]] for i in range(0, 48, 4)]
    mean = sum(map(sum, per_prompt)) / 48
    expected = {k: sum(pass_at_k(4, int(sum(r)), k) for r in per_prompt) / 12 for k in (1, 2, 4)}
    summary = re.search(r"mean@4 reward ([\d.]+), pass@1 ([\d.]+), pass@2 ([\d.]+), pass@4 ([\d.]+) on 12 scored", out)
    assert summary, out
    assert [float(x) for x in summary.groups()] == [round(v, 3) for v in (mean, expected[1], expected[2], expected[4])]
    assert "(step 2)" in out
    # the same seeds: the same samples
    _generate(capsys, str(run), "--out", str(tmp_path / "again.jsonl"), "--n", "4", "--limit", "12")
    assert _lines(tmp_path / "again.jsonl") == lines


def test_greedy_responses_are_the_held_out_evaluations(tmp_path, capsys):
    code, out, _ = _generate(capsys, GRPO, "--out", str(tmp_path / "g.jsonl"), "--greedy", "--limit", "16")
    assert code == 0 and "from the initial weights of embedded:arithmetic" in out
    cli = build_cli(["--config", GRPO, "--trainer.logger=false"], run=False, save_config=False)
    cli.datamodule.bind(cli.model.policy.eval(), cli.model.tokenizer)
    cli.datamodule.evaluation = Evaluation(batch_size=16, num_prompts=16)
    total, count = cli.datamodule.evaluate()
    lines = _lines(tmp_path / "g.jsonl")
    assert count == len(lines) == 16 and sum(s["reward"] for s in lines) == total


def test_prompts_from_a_file_with_and_without_answers(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "12+30=", "answer": "42"}\n{"prompt": "5+5="}\n')
    code, out, _ = _generate(capsys, GRPO, "--out", str(tmp_path / "o.jsonl"), "--prompts", str(prompts), "--n", "2")
    assert code == 0 and "on 1 scored prompts" in out
    lines = _lines(tmp_path / "o.jsonl")
    assert [s["answer"] for s in lines] == ["42", "42", None, None]
    assert [s["reward"] is None for s in lines] == [False, False, True, True]


def test_errors_are_one_line(run, tmp_path, capsys):
    for args, expected in ((["--n", "0"], "--n 0: must be >= 1"), (["--n", "2", "--k", "3"], "each k must be in 1..n"),
                           (["--prompts", str(tmp_path / "none.jsonl")], "no such prompt file")):
        code, _, err = _generate(capsys, str(run), "--out", str(tmp_path / "x.jsonl"), *args)
        lines = [line for line in err.splitlines() if line.startswith("rl-lightning generate: error")]
        assert code == 2 and len(lines) == 1 and expected in lines[0] and "Traceback" not in err, err
