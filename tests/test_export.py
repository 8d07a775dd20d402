"""``rl-lightning export``: a trained run as a Hugging Face checkpoint -- the full model (LoRA adapters merged) that
``AutoModelForCausalLM.from_pretrained`` loads, or the adapters alone that ``peft.PeftModel.from_pretrained`` loads
onto the base; errors in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_lightning.cli import build_cli, cli_main
from rl_lightning.models.adapters import merged_state_dict
from rl_lightning.models.policy import load_policy, resolve_model_path
from tests.conftest import REPO

TINY = ["--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--data.init_args.prompts_per_step=4", "--data.init_args.group_size=4",
        "--data.init_args.sampling.max_new_tokens=4",
        "--model.init_args.optimizer.init_args.lr=1e-2"]
LORA = ["--config", str(REPO / "configs" / "presets" / "lora.yaml")]


def _error_lines(err: str) -> list[str]:
    """The error lines of an export's stderr (a model load's progress bars aside), with no traceback."""
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("rl-lightning export: error")]


def _train(root: Path, *extra: str) -> Path:
    """A 2-step GRPO run under ``root``; returns its run directory."""
    cli_main(["fit", "--config", str(REPO / "configs" / "grpo.yaml"), *extra, *TINY,
              f"--trainer.logger.init_args.save_dir={root}"])
    (run,) = root.glob("grpo/version_*")
    return run


def _trained_policy(run: Path):  # noqa: ANN202
    """The run's policy as the checkpoint holds it, rebuilt independently of the exporter."""
    import yaml

    settings = yaml.safe_load((run / "config.yaml").read_text())
    settings.pop("ckpt_path", None), settings.pop("weights_only", None)
    settings["trainer"].update(logger=False, callbacks=None)
    module = build_cli(settings, run=False, save_config=False).model
    module.load_state_dict(torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"])
    return module.policy


def test_a_lora_run_exports_merged_weights_that_transformers_loads(tmp_path, capsys):
    run = _train(tmp_path / "runs", *LORA)
    with pytest.raises(SystemExit) as done:
        cli_main(["export", str(run), str(tmp_path / "merged")])
    assert done.value.code == 0
    assert "exported the full model with its LoRA adapters merged (load with" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    policy = _trained_policy(run)
    expected = merged_state_dict(policy)
    got = loaded.state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)  # written as merged
    assert any(not torch.equal(got[k], v) for k, v in load_policy("embedded:arithmetic")[0].state_dict().items())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert tokenizer("1+1=", add_special_tokens=False)["input_ids"]


def test_a_lora_run_exports_adapters_that_peft_loads_onto_the_base(tmp_path, capsys):
    import peft

    run = _train(tmp_path / "runs", *LORA)
    with pytest.raises(SystemExit) as done:
        cli_main(["export", str(run / "checkpoints" / "last.ckpt"), str(tmp_path / "adapters"), "--adapters"])
    assert done.value.code == 0
    assert (tmp_path / "adapters" / "adapter_config.json").is_file()
    assert not (tmp_path / "adapters" / "model.safetensors").exists()  # the adapters only
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("embedded:arithmetic"), local_files_only=True)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapters")
    policy = _trained_policy(run)
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same layers computing the same operations: bit for bit
        assert torch.equal(loaded(input_ids=ids).logits, policy.eval()(input_ids=ids).logits)


def test_a_run_without_adapters_exports_its_full_weights(tmp_path, capsys):
    run = _train(tmp_path / "runs")
    with pytest.raises(SystemExit) as done:
        cli_main(["export", str(run), str(tmp_path / "full")])
    assert done.value.code == 0
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "full", local_files_only=True).state_dict()
    expected = _trained_policy(run).state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(SystemExit) as refused:
        cli_main(["export", str(run), str(tmp_path / "x"), "--adapters"])
    assert refused.value.code == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert "has no LoRA adapters (model.init_args.lora is not set)" in line


def test_export_errors_are_one_line(tmp_path, capsys):
    for source, expected in ((tmp_path / "nothing", "no such run directory or checkpoint file"),
                             (tmp_path, "no checkpoint in")):
        with pytest.raises(SystemExit) as refused:
            cli_main(["export", str(source), str(tmp_path / "out")])
        assert refused.value.code == 2
        (line,) = _error_lines(capsys.readouterr().err)
        assert expected in line, line
