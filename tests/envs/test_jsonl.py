"""JSONL prompt files: loading, errors naming ``path:line``, and ``JsonlTask``'s held-out split and epochs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_lightning.envs import JsonlTask, Prompt, PromptFileError, read_prompt_file


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _records(n: int, prefix: str = "q") -> list[str]:
    return [json.dumps({"prompt": f"{prefix}{i}?", "answer": str(i)}) for i in range(n)]


def test_valid_file_loads_with_metadata_numbers_and_blank_lines(tmp_path):
    path = _write(tmp_path / "data.jsonl", [
        json.dumps({"prompt": "1+1=", "answer": "2", "source": "hand", "level": 1}),
        "",
        "   ",
        json.dumps({"prompt": "2*3=", "answer": 6}),
        json.dumps({"prompt": "half of 7", "answer": 3.5, "tags": ["x"]}),
        "",
    ])
    prompts = read_prompt_file(path)
    assert prompts == [
        Prompt("1+1=", "2", {"source": "hand", "level": 1}),
        Prompt("2*3=", "6", {}),
        Prompt("half of 7", "3.5", {"tags": ["x"]}),
    ]
    assert all(isinstance(p.answer, str) for p in prompts)
    # str paths work too
    assert read_prompt_file(str(path)) == prompts


def test_answer_optional_when_not_required(tmp_path):
    path = _write(tmp_path / "noans.jsonl", [json.dumps({"prompt": "hi"})])
    assert read_prompt_file(path, require_answer=False) == [Prompt("hi", None, {})]


GOOD = json.dumps({"prompt": "ok", "answer": "1"})


@pytest.mark.parametrize(
    ("bad_line", "what"),
    [
        ('{"prompt": "x", "answer": ', "invalid JSON"),
        ("not json at all", "invalid JSON"),
        ("[1, 2, 3]", "JSON object"),
        ('"just a string"', "JSON object"),
        (json.dumps({"question": "x", "answer": "1"}), "'prompt'"),
        (json.dumps({"prompt": 5, "answer": "1"}), "'prompt' must be a string"),
        (json.dumps({"prompt": None, "answer": "1"}), "'prompt' must be a string"),
        (json.dumps({"prompt": "x"}), "missing field 'answer'"),
        (json.dumps({"prompt": "x", "answer": None}), "missing field 'answer'"),
        (json.dumps({"prompt": "x", "answer": [1]}), "'answer' must be a string or number"),
    ],
)
def test_malformed_line_names_file_line_and_problem(tmp_path, bad_line, what):
    # line 1 good, line 2 blank (still counted), line 3 bad
    path = _write(tmp_path / "bad.jsonl", [GOOD, "", bad_line, GOOD])
    with pytest.raises(PromptFileError) as info:
        read_prompt_file(path)
    msg = str(info.value)
    assert f"{path}:3" in msg
    assert what in msg
    assert isinstance(info.value, ValueError)


def test_missing_prompt_message(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [json.dumps({"question": "x", "answer": "1"})])
    with pytest.raises(PromptFileError, match=r"bad\.jsonl:1: missing field 'prompt'"):
        read_prompt_file(path)


def test_non_utf8_line_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + '{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(PromptFileError) as info:
        read_prompt_file(path)
    assert f"{path}:2" in str(info.value)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(PromptFileError) as info:
        read_prompt_file(path)
    assert str(path) in str(info.value)
    assert "empty" in str(info.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(PromptFileError) as info:
        read_prompt_file(path)
    assert str(path) in str(info.value)
    with pytest.raises(PromptFileError, match="no such prompt file"):
        read_prompt_file(tmp_path)  # a directory is not a prompt file
    with pytest.raises(PromptFileError, match="nope.jsonl"):
        JsonlTask(str(path))


def _train_texts(task: JsonlTask, n: int) -> list[str]:
    return [task.train_prompt(i).text for i in range(n)]


def test_jsonl_task_with_heldout_file(tmp_path):
    train = _write(tmp_path / "train.jsonl", _records(7, "t"))
    held = _write(tmp_path / "held.jsonl", _records(3, "h"))
    task = JsonlTask(str(train), heldout_file=str(held), seed=1)
    assert [p.text for p in task.heldout_prompts()] == ["h0?", "h1?", "h2?"]  # file order
    stream = _train_texts(task, 7 * 6)
    assert not {"h0?", "h1?", "h2?"}.intersection(stream)
    assert set(stream) == {f"t{i}?" for i in range(7)}
    assert task.default_reward()(task.train_prompt(0), task.train_prompt(0).answer) == 1.0
    # a malformed held-out file is reported with its own path
    bad = _write(tmp_path / "badheld.jsonl", [GOOD, "{"])
    with pytest.raises(PromptFileError, match=r"badheld\.jsonl:2"):
        JsonlTask(str(train), heldout_file=str(bad))


def test_jsonl_task_carved_split_and_epochs(tmp_path):
    train = _write(tmp_path / "all.jsonl", _records(10))
    task = JsonlTask(str(train), num_heldout=3, seed=5)
    held = [p.text for p in task.heldout_prompts()]
    assert len(held) == 3 and len(set(held)) == 3
    n = 7
    stream = _train_texts(task, n * 5)
    # every pass (epoch) covers each training prompt exactly once
    passes = [stream[e * n:(e + 1) * n] for e in range(5)]
    train_set = set(passes[0])
    assert len(train_set) == n
    assert train_set | set(held) == {f"q{i}?" for i in range(10)}
    assert not train_set.intersection(held)
    for p in passes:
        assert sorted(p) == sorted(train_set)
    # reshuffled per epoch
    assert len({tuple(p) for p in passes}) > 1
    # deterministic for the seed, random access included
    again = JsonlTask(str(train), num_heldout=3, seed=5)
    assert [again.train_prompt(i).text for i in reversed(range(n * 5))] == stream[::-1]
    assert [p.text for p in again.heldout_prompts()] == held
    # another seed gives another split or order
    other = JsonlTask(str(train), num_heldout=3, seed=6)
    assert (_train_texts(other, n * 5), [p.text for p in other.heldout_prompts()]) != (stream, held)


def test_jsonl_task_heldout_list_is_a_copy(tmp_path):
    train = _write(tmp_path / "all.jsonl", _records(5))
    task = JsonlTask(str(train), num_heldout=2)
    task.heldout_prompts().clear()
    assert len(task.heldout_prompts()) == 2


@pytest.mark.parametrize("num_heldout", [4, 9])
def test_jsonl_task_num_heldout_leaving_nothing_raises(tmp_path, num_heldout):
    train = _write(tmp_path / "all.jsonl", _records(4))
    with pytest.raises(ValueError, match="num_heldout"):
        JsonlTask(str(train), num_heldout=num_heldout)


def test_jsonl_task_negative_num_heldout_raises(tmp_path):
    train = _write(tmp_path / "all.jsonl", _records(4))
    with pytest.raises(ValueError, match="num_heldout"):
        JsonlTask(str(train), num_heldout=-1)


def test_invalid_json_at_the_end_of_a_line_reports_its_column(tmp_path):
    line = '{"prompt": "12+13=", "answer": "25"'  # closing brace missing: the error is after the last character
    path = _write(tmp_path / "bad.jsonl", [GOOD, line, GOOD])
    with pytest.raises(PromptFileError, match=f"{path}:2: invalid JSON .* at column {len(line) + 1}"):
        read_prompt_file(path)
