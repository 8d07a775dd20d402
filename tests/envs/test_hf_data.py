"""Data and rewards a researcher brings (issue: real models): ``DatasetTask`` over local Hugging Face datasets (GSM8K's
own rows from parquet, column mapping, templates, chat messages and a system prompt, ``save_to_disk`` splits), the
math verifier with its fallback, and weighted rewards logged per part."""

from __future__ import annotations

import pytest
import torch

from rl_lightning import ConfigError
from rl_lightning.algorithms import GRPO
from rl_lightning.envs import (
    ArithmeticTask, BoxedFormatReward, DatasetTask, ExactMatchReward, MathVerifyReward, NumericAnswerReward, Prompt,
    WeightedRewards, score_parts,
)
from rl_lightning.envs import verifiers
from rl_lightning.rollout.encoding import PromptEncoder
from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer

GSM8K = {
    "question": [f"Tom has {a} apples and gets {b} more. How many apples does he have?" for a, b in
                 [(3, 4), (10, 5), (7, 8), (20, 22), (1, 1), (6, 9)]],
    "answer": [f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}" for a, b in
               [(3, 4), (10, 5), (7, 8), (20, 22), (1, 1), (6, 9)]],
}


@pytest.fixture
def gsm8k_parquet(tmp_path):
    import datasets

    path = tmp_path / "gsm8k.parquet"
    datasets.Dataset.from_dict(GSM8K).to_parquet(str(path))
    return path


def test_gsm8k_rows_from_parquet_work_as_they_are(gsm8k_parquet):
    task = DatasetTask(str(gsm8k_parquet), num_heldout=2, num_validation=1)
    train = [task.train_prompt(i) for i in range(3)]
    held, val = task.heldout_prompts(), task.validation_prompts()
    assert len(held) == 2 and len(val) == 1
    texts = {p.text for p in [*held, *val]}
    assert not texts & {task.train_prompt(i).text for i in range(30)}  # never trained on
    assert set(GSM8K["question"]) == texts | {task.train_prompt(i).text for i in range(3)}
    prompt = train[0]
    total = int(prompt.answer.rsplit("####", 1)[1])
    reward = task.default_reward()
    assert isinstance(reward, MathVerifyReward)
    assert reward(prompt, f"So {total}. \\boxed{{{total}}}") == 1.0
    assert reward(prompt, f"The answer is \\boxed{{\\frac{{{2 * total}}}{{2}}}}") == 1.0
    assert reward(prompt, f"\\boxed{{{total}}} (checked in 2 steps)") == 1.0
    assert reward(prompt, f"\\boxed{{{total + 1}}}") == 0.0
    assert NumericAnswerReward()(prompt, f"#### {total}") == 1.0


def test_columns_are_mapped_and_a_template_formats_the_row(tmp_path):
    import datasets

    path = tmp_path / "mine.jsonl"
    datasets.Dataset.from_dict({"problem": ["2+2", "3+3", "4+4"], "solution": ["4", "6", "8"],
                                "level": ["a", "b", "c"]}).to_json(str(path))
    task = DatasetTask(str(path), num_heldout=1, prompt_column="problem", answer_column="solution",
                       template="Level {level}: {problem} = ?")
    prompts = [*task.heldout_prompts(), *(task.train_prompt(i) for i in range(2))]
    assert {p.text for p in prompts} == {"Level a: 2+2 = ?", "Level b: 3+3 = ?", "Level c: 4+4 = ?"}
    assert all(p.metadata == {} for p in prompts) and not task.needs_chat_template()
    with pytest.raises(ConfigError,
                       match=r"no column 'answer', 'question' \(columns: \['problem', 'solution', 'level'\]\)"):
        DatasetTask(str(path))
    with pytest.raises(ConfigError, match=r"no column 'grade'"):
        DatasetTask(str(path), prompt_column="problem", answer_column="solution", template="{grade}")


def test_paths_that_are_not_local_data_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"openai/gsm8k: no such file or directory \(datasets are never downloaded "
                                          r"at run time: download it yourself"):
        DatasetTask("openai/gsm8k")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ConfigError, match=r"unknown data file type '.txt'"):
        DatasetTask(str(tmp_path / "x.txt"))


def test_a_saved_dataset_dict_gives_its_splits(tmp_path):
    import datasets

    data = datasets.DatasetDict({"train": datasets.Dataset.from_dict(GSM8K),
                                 "test": datasets.Dataset.from_dict({k: v[:2] for k, v in GSM8K.items()})})
    data.save_to_disk(str(tmp_path / "saved"))
    task = DatasetTask(str(tmp_path / "saved"), heldout_path=str(tmp_path / "saved"))
    assert len(task.heldout_prompts()) == 6  # heldout_path read with the same split name ...
    with pytest.raises(ConfigError,
                       match=r"no split 'validation' in the saved dataset \(splits: \['test', 'train'\]\)"):
        DatasetTask(str(tmp_path / "saved"), split="validation")


def test_chat_messages_and_a_system_prompt_reach_the_chat_template(tmp_path):
    import datasets

    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "What is 2+2?"}]],
                                "answer": ["4"]}).to_parquet(str(path))
    with_system = DatasetTask(str(path), messages_column="messages", system_prompt="Answer in \\boxed{}.")
    (prompt,) = [with_system.train_prompt(0)]
    assert prompt.text == "What is 2+2?" and with_system.needs_chat_template()
    assert prompt.metadata["messages"] == [{"role": "system", "content": "Answer in \\boxed{}."},
                                           {"role": "user", "content": "What is 2+2?"}]

    class Tokenizer:  # renders a conversation as role:content lines; ids are character codes
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):  # noqa: ANN001, ANN201
            return "".join(f"{m['role']}:{m['content']}|" for m in messages) + ("assistant:" * add_generation_prompt)

        def __call__(self, text, add_special_tokens):  # noqa: ANN001, ANN204
            return {"input_ids": [ord(c) for c in text]}

    encoder = PromptEncoder(Tokenizer(), use_chat_template=True)
    (ids, plain) = encoder.first([prompt.text, "hi"], [prompt.metadata["messages"], None])
    assert "".join(map(chr, ids)) == "system:Answer in \\boxed{}.|user:What is 2+2?|assistant:"
    assert "".join(map(chr, plain)) == "user:hi|assistant:"
    with pytest.raises(ConfigError, match=r"use_chat_template=false, but DatasetTask's prompts are chat messages"):
        tiny_datamodule(task=with_system)


def test_the_math_verifier_falls_back_to_the_numeric_reader(monkeypatch):
    prompt = Prompt("q", "... #### 42")
    monkeypatch.setattr(verifiers, "_math_verify", lambda: None)
    reward = MathVerifyReward()
    assert reward(prompt, "\\boxed{42}") == 1.0 and reward(prompt, "\\boxed{\\frac{84}{2}}") == 1.0
    assert reward(prompt, "\\sqrt{1764}") == 0.0  # the numeric reader does no algebra
    with pytest.raises(ImportError, match="MathVerifyReward needs math-verify"):
        MathVerifyReward(fallback=False)


def test_weighted_rewards_combine_their_parts_and_refuse_bad_names():
    combined = WeightedRewards({"correct": NumericAnswerReward(), "format": BoxedFormatReward()},
                               weights={"format": 0.5})
    prompt = Prompt("q", "7")
    assert score_parts(combined, prompt, "\\boxed{7}") == (1.5, {"correct": 1.0, "format": 1.0})
    assert score_parts(combined, prompt, "7") == (1.0, {"correct": 1.0, "format": 0.0})
    assert score_parts(combined, prompt, "\\boxed{8}") == (0.5, {"correct": 0.0, "format": 1.0})
    assert score_parts(ExactMatchReward(), prompt, "7") == (1.0, {})
    with pytest.raises(ConfigError, match=r"weights \['style'\] name no reward"):
        WeightedRewards({"correct": NumericAnswerReward()}, weights={"style": 1.0})
    with pytest.raises(ConfigError, match=r"reward names \['a b'\] must be"):
        WeightedRewards({"a b": NumericAnswerReward()})


class _EndsWithDigit(ExactMatchReward):
    def __call__(self, prompt, response):  # noqa: ANN001, ANN204
        return 1.0 if response[-1:].isdigit() else 0.0


def test_each_part_is_logged_and_the_reward_is_their_weighted_sum(tmp_path):
    """``train/reward/<name>`` is each part's mean over the step's responses and ``train/reward`` the weighted sum
    (weights 1 and 0.5 on 0/1 values over 16 rows: every sum here is exact in binary, so equality is exact)."""
    torch.manual_seed(0)
    reward = WeightedRewards({"correct": ExactMatchReward(), "digit": _EndsWithDigit()}, weights={"digit": 0.5})
    module, record = GRPO(model_name_or_path="embedded:arithmetic"), RecordRollouts()
    dm = tiny_datamodule(task=ArithmeticTask(num_heldout=16), reward_fn=reward)
    tiny_trainer(tmp_path, max_steps=2, callbacks=[record]).fit(module, datamodule=dm)
    for m in record.metrics:
        assert m["train/reward"] == m["train/reward/correct"] + 0.5 * m["train/reward/digit"]
    assert any(m["train/reward/digit"] > 0 for m in record.metrics)


def test_a_fit_trains_from_a_local_parquet_file_as_the_docs_show(gsm8k_parquet, tmp_path):
    """docs/real_models.md's own-data command on the embedded model (2 steps): the task switched on the command
    line to DatasetTask over GSM8K-format rows, the math verifier as its reward."""
    from rl_lightning.cli import build_cli
    from tests.conftest import REPO

    cli = build_cli(["--config", str(REPO / "configs" / "grpo.yaml"),
                     "--data.init_args.task", "rl_lightning.envs.DatasetTask",
                     "--data.init_args.task.init_args.train_path", str(gsm8k_parquet),
                     "--data.init_args.task.init_args.num_heldout", "2",
                     "--data.init_args.prompts_per_step=2", "--data.init_args.group_size=2",
                     "--data.init_args.sampling.max_new_tokens=4", "--data.init_args.evaluation.batch_size=2",
                     "--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                     f"--trainer.default_root_dir={tmp_path}"], run=False, save_config=False)
    assert isinstance(cli.datamodule.task, DatasetTask)
    record = RecordRollouts()
    cli.trainer.callbacks.append(record)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert len(record.metrics) == 2 and cli.trainer.global_step == 2
    assert isinstance(cli.datamodule.reward_fn, MathVerifyReward)
