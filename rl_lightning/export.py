"""``rl-lightning export <run or checkpoint> <dir>``: the trained policy as a Hugging Face checkpoint.

The run is built from its ``config.yaml`` (nothing trained, nothing written there), its checkpoint's weights are
loaded (``checkpoints/last.ckpt`` of a run directory, or the checkpoint file given), and ``<dir>`` receives:

* by default, the full model with any LoRA adapters merged (``W + (α/r) B A``; ``models.adapters.merged_state_dict``)
  and the tokenizer: ``AutoModelForCausalLM.from_pretrained(dir)`` loads it, and so does vLLM;
* with ``--adapters``, the LoRA adapters only, in peft's format (``adapter_config.json`` naming the base model's
  directory, ``adapter_model.safetensors``) and the tokenizer: ``PeftModel.from_pretrained(base, dir)`` loads them.

The run is built by the function the caller passes (the CLI passes its ``build_cli``), as for ``replay``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl_lightning.models.adapters import LoraSettings, adapter_state_dict, has_adapters, merged_state_dict, peft_config
from rl_lightning.models.policy import load_policy, resolve_model_path
from rl_lightning.runs import CheckpointError, last_checkpoint_in, read_checkpoint, run_dir_of, run_settings


class ExportError(Exception):
    """A run that cannot be exported as asked (one line)."""


def locate_run(source: Path) -> tuple[Path, Path]:
    """``(run directory, checkpoint)`` of a run directory or of a checkpoint file inside one."""
    if source.is_dir():
        checkpoint = last_checkpoint_in(source)
        if checkpoint is None:
            raise ExportError(f"{source}: no checkpoint in {source / 'checkpoints'}")
        run_dir: Path | None = source
    elif source.is_file():
        checkpoint, run_dir = source, run_dir_of(source)
    else:
        raise ExportError(f"{source}: no such run directory or checkpoint file")
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{source}: no config.yaml in the run directory (the run's configuration is needed to "
                          f"rebuild its model)")
    return run_dir, checkpoint


def rebuild(source: Path, build_cli: Callable[..., Any]) -> tuple[Any, Path, Path, dict[str, Any]]:
    """``(cli, run directory, checkpoint path, checkpoint)`` of a run directory or a checkpoint file in one: the run
    built from its ``config.yaml`` (no logger, no checkpoints, no callbacks) and its checkpoint, read."""
    run_dir, checkpoint_path = locate_run(source)
    checkpoint = read_checkpoint(checkpoint_path)
    settings = run_settings(run_dir / "config.yaml", logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, callbacks=None)
    return build_cli(settings, run=False, save_config=False), run_dir, checkpoint_path, checkpoint


def export(source: str | Path, out: str | Path, build_cli: Callable[..., Any], adapters: bool = False) -> str:
    """Write the policy of ``source`` (a run directory or a checkpoint file in one) to ``out``; returns what was
    written, in words. Raises ``ExportError`` (or ``CheckpointError``) with one line."""
    cli, run_dir, checkpoint_path, checkpoint = rebuild(Path(source), build_cli)
    module = cli.model
    module.load_state_dict(checkpoint["state_dict"])  # strict: a LoRA run's file holds the adapters only
    policy, tokenizer = module.policy, module.tokenizer
    out = Path(out)
    step = int(checkpoint.get("global_step", 0))
    if adapters:
        if not has_adapters(policy):
            raise ExportError(f"{run_dir}: --adapters, but the run's policy has no LoRA adapters (model.init_args.lora "
                              f"is not set); export the full weights without --adapters")
        _write_adapters(policy, tokenizer, module.hparams["model_name_or_path"], out)
        what = "LoRA adapters (load with peft.PeftModel.from_pretrained(base, dir))"
    else:
        policy.save_pretrained(out, state_dict=merged_state_dict(policy), safe_serialization=True)
        tokenizer.save_pretrained(out)
        merged = " with its LoRA adapters merged" if has_adapters(policy) else ""
        what = f"the full model{merged} (load with AutoModelForCausalLM.from_pretrained(dir))"
    return f"exported {what} of step {step} from {checkpoint_path} to {out}"


def _write_adapters(policy: Any, tokenizer: Any, model_name_or_path: str, out: Path) -> None:
    import peft

    base, _ = load_policy(model_name_or_path, str(next(policy.parameters()).dtype).removeprefix("torch."))
    path = resolve_model_path(model_name_or_path)
    settings = LoraSettings(**policy.lora_settings)
    wrapped = peft.get_peft_model(base, peft_config(settings, str(path) if path is not None else model_name_or_path))
    missing, unexpected = wrapped.base_model.model.load_state_dict(adapter_state_dict(policy), strict=False)
    if unexpected or any(".lora_" in k for k in missing):
        raise ExportError(f"the adapters do not match peft's layout (unexpected {unexpected[:3]}, missing "
                          f"{[k for k in missing if '.lora_' in k][:3]})")
    wrapped.save_pretrained(out)
    tokenizer.save_pretrained(out)


def export_main(argv: list[str], build_cli: Callable[..., Any]) -> int:
    """The ``rl-lightning export`` subcommand (``build_cli`` as for ``export``)."""
    parser = argparse.ArgumentParser(prog="rl-lightning export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a run directory (its checkpoints/last.ckpt) or a checkpoint file in one")
    parser.add_argument("out", help="the directory to write the Hugging Face checkpoint into")
    parser.add_argument("--adapters", action="store_true", help="write the LoRA adapters only (peft's format)")
    args = parser.parse_args(argv)
    try:
        line = export(args.source, args.out, build_cli, adapters=args.adapters)
    except (ExportError, CheckpointError) as err:
        print(f"rl-lightning export: error: {err}", file=sys.stderr)
        return 2
    print(f"rl-lightning: {line}")
    return 0
