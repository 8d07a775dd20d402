"""Policy construction: the char tokenizer, the embedded models, local checkpoints and clear path errors."""

from __future__ import annotations

import logging
import shutil
import string

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rl_lightning.models import build_char_tokenizer, build_tiny_policy, load_policy, resolve_model_path
from rl_lightning.models.policy import ASSETS

TEXTS = ["37+48=85", "Hello,  World! ~{}", " leading and trailing ", string.printable[:95], "a"]


# ---------------------------------------------------------------------------------------------------------------
# tokenizer
def test_char_tokenizer_ids_and_round_trip():
    tok = build_char_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4 + 95
    assert tok("37+48=")["input_ids"] == [7, 11, 24, 8, 12, 32]
    assert tok.decode([12, 9]) == "85"
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one token per character, spaces included
        assert tok.decode(ids) == text
    # special tokens are dropped on request; unknown characters map to <unk>
    assert tok.decode([1, 7, 2, 0, 0], skip_special_tokens=True) == "3"
    assert tok("é\n", add_special_tokens=False)["input_ids"] == [3, 3]


def test_char_tokenizer_save_load_same_ids_left_padding(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"]) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.padding_side == "left"
    batch = loaded(["1+2=", "37+48="], padding=True)
    assert batch["input_ids"] == [[0, 0, 5, 24, 6, 32], [7, 11, 24, 8, 12, 32]]
    assert batch["attention_mask"] == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]


# ---------------------------------------------------------------------------------------------------------------
# embedded models
def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_embedded_random_is_tiny_llama():
    model, tok = load_policy("embedded:random")
    assert isinstance(model, LlamaForCausalLM)
    assert 1_000_000 <= _num_params(model) <= 1_200_000
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (128, 4, 4, 512)
    assert cfg.vocab_size == len(tok) == 99
    assert ((cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id)
            == (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id))
    assert tok.padding_side == "left"
    assert next(model.parameters()).dtype == torch.float32
    # deterministic: the same weights every time
    again, _ = load_policy("embedded:random")
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name
    out = model(input_ids=torch.tensor([tok("1+2=")["input_ids"]]))
    assert out.logits.shape == (1, 4, 99)


def test_build_tiny_policy_seed_and_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a, _ = build_tiny_policy(seed=0)
    assert torch.equal(torch.rand(3), expected)  # building does not consume the global RNG
    b, _ = build_tiny_policy(seed=1)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_embedded_random_bfloat16():
    model, _ = load_policy("embedded:random", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("name", ["arithmetic", "arithmetic_hard"])
def test_embedded_arithmetic_asset_is_small_and_loads(name):
    asset = ASSETS / name
    assert resolve_model_path(f"embedded:{name}") == asset
    assert (asset / "config.json").is_file()
    weights = asset / "model.safetensors"
    assert weights.is_file()
    assert weights.stat().st_size < 5 * 1024 * 1024
    model, tok = load_policy(f"embedded:{name}")
    assert isinstance(model, LlamaForCausalLM)
    assert 1_000_000 <= _num_params(model) <= 1_200_000
    assert model.config.vocab_size == len(tok)
    assert tok.padding_side == "left" and tok.pad_token_id == 0 and tok.eos_token_id == 2
    assert tok("37+48=")["input_ids"] == [7, 11, 24, 8, 12, 32]
    random_model, _ = load_policy("embedded:random")
    assert not torch.equal(model.lm_head.weight, random_model.lm_head.weight)  # really a trained checkpoint


def test_embedded_arithmetic_is_sometimes_right():
    from rl_lightning.envs import ArithmeticTask
    from rl_lightning.rollout import SamplingParams, sample

    model, tok = load_policy("embedded:arithmetic")
    prompts = ArithmeticTask().heldout_prompts()[:64]
    rows = [[tok.bos_token_id, *tok(p.text, add_special_tokens=False)["input_ids"]] for p in prompts]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    gen = sample(model.eval(), ids, mask, SamplingParams(6, tok.eos_token_id, tok.pad_token_id, greedy=True))
    answers = tok.batch_decode([r[m.bool()].tolist() for r, m in zip(gen.response_ids, gen.mask)],
                               skip_special_tokens=True)
    correct = sum(a == p.answer for a, p in zip(answers, prompts))
    assert 3 <= correct < 64, answers  # the warm start is "sometimes right"


# ---------------------------------------------------------------------------------------------------------------
# local checkpoints and errors
def test_local_checkpoint_loads_via_path(tmp_path):
    model, tok = build_tiny_policy(seed=3, num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_policy(str(tmp_path))
    assert isinstance(loaded, LlamaForCausalLM)
    assert loaded.config.num_hidden_layers == 1 and loaded.config.hidden_size == 32
    for (name, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), name
    assert loaded_tok("37+48=")["input_ids"] == tok("37+48=")["input_ids"]
    assert loaded_tok.padding_side == "left"
    # a Path-like string with a trailing slash works too
    again, _ = load_policy(str(tmp_path) + "/")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


@pytest.fixture
def lightning_logs(caplog, monkeypatch):
    """``caplog`` that also sees ``rank_zero_info`` (logger ``lightning.pytorch.utilities.rank_zero``), whose
    parent ``lightning.pytorch`` stops propagation when it was imported before the root logger had handlers."""
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        yield caplog


def test_local_checkpoint_without_pad_token_pads_with_eos(tmp_path, lightning_logs):
    model, tok = build_tiny_policy(num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64)
    tok.pad_token = None
    tok.padding_side = "right"
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    _, loaded_tok = load_policy(str(tmp_path))
    assert loaded_tok.pad_token_id == loaded_tok.eos_token_id == 2
    assert loaded_tok.padding_side == "left"
    said = [r.getMessage() for r in lightning_logs.records if "pad token" in r.getMessage()]
    assert len(said) == 1, lightning_logs.records  # stated once, at INFO: the user sees it
    assert str(tmp_path) in said[0] and "no pad token" in said[0] and "EOS" in said[0] and "id 2" in said[0]


def test_pad_token_present_is_not_mentioned(tmp_path, lightning_logs):
    model, tok = build_tiny_policy(num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    load_policy(str(tmp_path))
    assert not [r for r in lightning_logs.records if "pad token" in r.getMessage()]


def _save_weights_only(path) -> None:
    """The embedded warm start's config and weights, without its tokenizer files."""
    path.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ASSETS / "arithmetic" / name, path / name)


def test_directory_without_tokenizer_files_is_refused(tmp_path):
    _save_weights_only(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        load_policy(str(tmp_path))
    _assert_one_line_naming_path(info.value, str(tmp_path))
    assert "tokenizer.json" in str(info.value) and "vocab.json" in str(info.value)


def test_tokenizer_config_without_vocabulary_is_refused(tmp_path):
    _save_weights_only(tmp_path)
    shutil.copy(ASSETS / "arithmetic" / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    with pytest.raises(FileNotFoundError) as info:
        load_policy(str(tmp_path))
    _assert_one_line_naming_path(info.value, str(tmp_path))
    assert "tokenizer_config.json holds no vocabulary" in str(info.value)


def test_architecture_whose_tokenizer_builds_empty_is_refused(tmp_path):
    """For Qwen2 (or GPT-2) configs Hugging Face builds an empty tokenizer from no files: vocab 1, text -> []."""
    config = Qwen2Config(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, eos_token_id=2)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    empty = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert empty("1+1=", add_special_tokens=False)["input_ids"] == []  # what would train silently
    with pytest.raises(FileNotFoundError) as info:
        load_policy(str(tmp_path))
    _assert_one_line_naming_path(info.value, str(tmp_path))
    assert "tokenizer.json" in str(info.value)


def test_tokenizer_that_encodes_text_to_nothing_is_refused(tmp_path):
    model, _ = build_tiny_policy(num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64)
    empty = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token="<eos>", pad_token="<eos>")
    assert empty("Hello", add_special_tokens=False)["input_ids"] == []
    model.save_pretrained(tmp_path)
    empty.save_pretrained(tmp_path)  # a tokenizer.json is there, but with an empty vocabulary
    with pytest.raises(ValueError, match="encodes .* to no tokens") as info:
        load_policy(str(tmp_path))
    _assert_one_line_naming_path(info.value, str(tmp_path))


def test_tokenizer_without_eos_is_refused(tmp_path):
    model, tok = build_tiny_policy(num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64)
    tok.eos_token = None
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no EOS token") as info:
        load_policy(str(tmp_path))
    _assert_one_line_naming_path(info.value, str(tmp_path))


def _assert_one_line_naming_path(err: BaseException, path: str) -> None:
    msg = str(err)
    assert "\n" not in msg.strip(), msg
    assert "model_name_or_path" in msg
    assert path in msg


def test_missing_directory_raises_one_line(tmp_path):
    path = str(tmp_path / "does_not_exist")
    with pytest.raises(FileNotFoundError) as info:
        load_policy(path)
    _assert_one_line_naming_path(info.value, path)


def test_directory_without_config_raises_one_line(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"junk")
    with pytest.raises(FileNotFoundError) as info:
        load_policy(str(tmp_path))
    _assert_one_line_naming_path(info.value, str(tmp_path))
    assert "config.json" in str(info.value)


def test_directory_with_config_but_no_weights_raises_one_line(tmp_path):
    model, tok = build_tiny_policy(num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64)
    model.config.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        load_policy(str(tmp_path))
    _assert_one_line_naming_path(info.value, str(tmp_path))


def test_unknown_embedded_name_lists_available():
    with pytest.raises(FileNotFoundError) as info:
        load_policy("embedded:nonexistent")
    msg = str(info.value)
    assert "model_name_or_path" in msg and "nonexistent" in msg
    assert "random" in msg and "arithmetic" in msg
