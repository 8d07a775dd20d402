"""Run directories and resuming them.

Every run owns one directory, the TensorBoard logger's ``log_dir`` (``runs/<name>/version_<N>``): its event files,
``config.yaml`` (the resolved configuration, with the version pinned), ``checkpoints/`` and ``failures/``.
``--ckpt_path`` takes

* ``last``: the newest run of the configured logger name (or the version the configuration pins) that holds a
  checkpoint, its ``checkpoints/last.ckpt``;
* a run directory: its ``checkpoints/last.ckpt``;
* a checkpoint file.

The resumed run writes into the run directory the checkpoint belongs to, so its TensorBoard curves continue
(events after the checkpoint's step are purged, not overlapped). A checkpoint records the identity of its run
(method, model, data module and task settings); resuming it with a configuration whose identity differs is
refused with the differing fields listed, and with the newest run of this identity to resume instead
(``newest_run_of``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_KEY = "rl_lightning_run"  # where the run identity is stored in a checkpoint
_VERSION_DIR = re.compile(r"version_(\d+)$")


class CheckpointError(ValueError):
    """A ``--ckpt_path`` that cannot be resumed (missing, unreadable, another run's)."""


@dataclass
class ResumeTarget:
    """A checkpoint to resume and the run directory it belongs to (``None`` when it lies outside any run)."""

    path: Path
    run_dir: Path | None
    checkpoint: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.checkpoint.get("global_step", 0))


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load ``path`` lazily (memory-mapped) or raise one ``CheckpointError`` line naming the file."""
    if not path.is_file():
        raise CheckpointError(f"--ckpt_path {path}: no such file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"--ckpt_path {path}: the file is empty (a write that was interrupted?)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 -- any failure to read is reported as one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"--ckpt_path {path}: not a readable checkpoint ({type(err).__name__}: "
                              f"{first[:200]})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"--ckpt_path {path}: not a Lightning checkpoint (no state_dict)")
    return checkpoint


def run_dir_of(path: Path) -> Path | None:
    """The run directory a checkpoint file lies in: the nearest of its parents (up to 3 up) with a config.yaml."""
    for parent in list(path.resolve().parents)[:3]:
        if (parent / "config.yaml").is_file():
            return parent
    return None


def _version_key(path: Path) -> int:
    match = _VERSION_DIR.search(path.name)
    return int(match.group(1)) if match else -1


def last_checkpoint_in(run_dir: Path) -> Path | None:
    """``run_dir/checkpoints/last.ckpt``, else the newest ``*.ckpt`` there, else ``None``."""
    folder = run_dir / "checkpoints"
    if (folder / "last.ckpt").is_file():
        return folder / "last.ckpt"
    candidates = sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    return candidates[-1] if candidates else None


def checkpointed_runs(run_root: Path) -> list[tuple[Path, Path]]:
    """``(run directory, its last checkpoint)`` of every ``run_root/version_*`` that holds one, newest first."""
    runs = sorted((p for p in run_root.glob("version_*") if p.is_dir()), key=_version_key, reverse=True)
    return [(run, found) for run in runs for found in [last_checkpoint_in(run)] if found is not None]


def find_last(run_root: Path, version: str | int | None) -> Path | None:
    """The checkpoint ``--ckpt_path last`` means under ``run_root`` (``save_dir/name``)."""
    if version is not None:
        name = version if isinstance(version, str) else f"version_{version}"
        return last_checkpoint_in(run_root / name)
    runs = checkpointed_runs(run_root)
    return runs[0][1] if runs else None


def newest_run_of(run_root: Path, identity: dict[str, Any]) -> Path | None:
    """The newest run under ``run_root`` whose last checkpoint records ``identity`` (see ``run_identity``)."""
    for run, checkpoint in checkpointed_runs(run_root):
        try:
            saved = (read_checkpoint(checkpoint).get(CHECKPOINT_KEY) or {}).get("identity")
        except CheckpointError:
            continue
        if saved is not None and not identity_differences(saved, identity):
            return run
    return None


def resolve(spec: str, run_root: Path | None, version: str | int | None) -> Path | None:
    """The checkpoint file ``--ckpt_path spec`` names (``None``: ``last`` found nothing)."""
    if spec == "last":
        return find_last(run_root, version) if run_root is not None else None
    path = Path(spec).expanduser()
    if path.is_dir():
        found = last_checkpoint_in(path)
        if found is None:
            raise CheckpointError(f"--ckpt_path {spec}: the directory holds no checkpoint (looked in "
                                  f"{path / 'checkpoints'})")
        return found
    return path


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}", item, out)
    else:
        out[prefix] = list(value) if isinstance(value, tuple) else value


def run_identity(config: dict[str, Any]) -> dict[str, Any]:
    """The settings that define which run a checkpoint belongs to, flattened to dotted keys.

    The method (``model.class_path``), the model it starts from (``model.init_args.model_name_or_path``), the
    data module class and its task (class and every task setting: the prompt stream and the held-out set).
    Learning rates, batch sizes and other hyperparameters may change on resume; these may not.
    """
    model = config.get("model") or {}
    data = config.get("data") or {}
    identity: dict[str, Any] = {
        "model.class_path": model.get("class_path"),
        "model.init_args.model_name_or_path": (model.get("init_args") or {}).get("model_name_or_path"),
        "data.class_path": data.get("class_path"),
    }
    _flatten("data.init_args.task", (data.get("init_args") or {}).get("task"), identity)
    return identity


def identity_differences(saved: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """``"key: saved in the checkpoint, given now"`` for each identity field that differs."""
    keys = sorted(set(saved) | set(given))
    other_class = [key[: -len("class_path")] for key in keys
                   if key.endswith(".class_path") and saved.get(key) != given.get(key)]

    def shown(mapping: dict[str, Any], key: str) -> str:
        return repr(mapping[key]) if key in mapping else "absent"

    return [f"{key}: {shown(saved, key)} in the checkpoint, {shown(given, key)} now" for key in keys
            if saved.get(key) != given.get(key)
            and not any(key.startswith(prefix) and not key.endswith(".class_path") for prefix in other_class)]


def architecture_differences(saved: dict[str, Any], current: dict[str, torch.Tensor], limit: int = 3) -> list[str]:
    """Parameters whose presence or shape differs between a checkpoint's ``state_dict`` and the model's."""
    differ = []
    for key in sorted(set(saved) | set(current)):
        if key not in saved:
            differ.append(f"{key} missing from the checkpoint")
        elif key not in current:
            differ.append(f"{key} not in the model")
        elif tuple(saved[key].shape) != tuple(current[key].shape):
            differ.append(f"{key} {list(saved[key].shape)} in the checkpoint, {list(current[key].shape)} now")
    if len(differ) > limit:
        differ = [*differ[:limit], f"and {len(differ) - limit} more"]
    return differ


def run_settings(config: Path, **trainer: Any) -> dict[str, Any]:
    """A run's saved ``config.yaml`` as settings to rebuild it outside ``fit`` (replay, export, generate): the
    arguments of ``fit`` itself (``ckpt_path``, ``weights_only``) dropped and ``trainer`` merged into its trainer
    settings (no logger, no checkpoints, ...)."""
    import yaml

    settings = yaml.safe_load(config.read_text())
    for key in ("ckpt_path", "weights_only"):
        settings.pop(key, None)
    settings["trainer"].update(trainer)
    return settings

