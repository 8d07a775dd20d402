"""Find every unknown key and plainly mistyped value of a configuration, with the file and line it came from.

``jsonargparse`` stops at the first problem and wraps it in a dozen lines about union subtypes. When it refuses a
configuration, the CLI runs ``check`` over the same sources (the ``--config`` files in order, then the
command-line overrides) to list every problem on one line each: ``configs/grpo.yaml:12: model.init_args.lr_rate:
unknown key (did you mean ...?)``. The check knows the classes' signatures only; anything it cannot judge it
leaves to jsonargparse's own message.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import yaml

#: where short class names (``--model GRPO``) are looked up, in order
_SHORT_NAME_MODULES = (
    "rl_lightning", "rl_lightning.algorithms", "rl_lightning.rollout", "rl_lightning.envs", "rl_lightning.callbacks",
    "torch.optim", "torch.optim.lr_scheduler", "lightning.pytorch.callbacks", "lightning.pytorch.loggers",
)
#: top-level keys of the command line that are not a class (and ``optimizer``/``lr_scheduler``, refused)
_TOP_LEVEL = {"config", "seed_everything", "ckpt_path", "weights_only", "print_config", "help"}
_HINTS = {
    "optimizer": "set the optimizer in one place only, as model.init_args.optimizer (e.g. --model.init_args.optimizer "
                 "torch.optim.SGD --model.init_args.optimizer.init_args.lr 0.1)",
    "lr_scheduler": "set the scheduler as model.init_args.lr_scheduler",
}


@dataclass
class Problem:
    key: str
    message: str
    source: str  # "configs/grpo.yaml:12" or "command line"

    def __str__(self) -> str:
        return f"{self.source}: {self.key}: {self.message}"


# ------------------------------------------------------------------------------------------- gathering the sources
def _yaml_lines(path: Path) -> dict[str, int]:
    """Dotted key -> 1-based line of every mapping key in a YAML file (list items as ``key[i]``)."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                lines[key] = key_node.start_mark.line + 1
                walk(value_node, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{prefix}[{i}]")

    try:
        root = yaml.compose(path.read_text())
    except (OSError, yaml.YAMLError):
        return lines
    if root is not None:
        walk(root, "")
    return lines


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if isinstance(child, str):  # "--model GRPO" then "--model.init_args.x": the string is the class path
            child = {"class_path": child}
        if not isinstance(child, dict):
            child = {}
        node[part] = child
        node = child
    node[parts[-1]] = value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            same_class = value.get("class_path") in (None, base[key].get("class_path"))
            base[key] = _merge(base[key], value) if same_class else value
        else:
            base[key] = value
    return base


def gather(args: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The merged configuration of ``args`` (after the subcommand) and where each dotted key came from."""
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            i += 1
            continue
        key, eq, value = arg[2:].partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "true"
            i += 1
        i += 1
        if key in ("config", "c"):
            path = Path(value)
            try:
                loaded = yaml.safe_load(path.read_text()) or {}
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(loaded, dict):
                tree = _merge(tree, loaded)
                for dotted, line in _yaml_lines(path).items():
                    sources[dotted] = f"{path}:{line}"
            continue
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        _set(tree, key.rstrip("+"), parsed)
        sources[key.rstrip("+")] = "command line"
    return tree, sources


# ------------------------------------------------------------------------------------------- classes and types
def resolve_class(name: Any) -> type | None:
    """The class a ``class_path`` names (dotted path, or a short name exported by a known module)."""
    if not isinstance(name, str) or not name:
        return None
    if "." in name:
        module_name, _, attr = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), attr, None)
        except Exception:  # noqa: BLE001 -- an unimportable path is jsonargparse's to report
            return None
    for module_name in _SHORT_NAME_MODULES:
        try:
            found = getattr(importlib.import_module(module_name), name, None)
        except Exception:  # noqa: BLE001
            continue
        if isinstance(found, type):
            return found
    return None


def init_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The ``__init__`` parameters a class accepts, following ``**kwargs`` up the MRO as jsonargparse does."""
    params: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            signature = inspect.signature(init)
        except (TypeError, ValueError):
            break
        forwards = False
        for name, param in signature.parameters.items():
            if name == "self" or param.kind == param.VAR_POSITIONAL:
                continue
            if param.kind == param.VAR_KEYWORD:
                forwards = True
            else:
                params.setdefault(name, param)
        if not forwards:
            break
    return params


def _hints(cls: type) -> dict[str, Any]:
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            hints.update(typing.get_type_hints(init))
        except Exception:  # noqa: BLE001 -- unresolvable annotations are simply not checked
            continue
    return hints


def _members(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def type_problem(value: Any, annotation: Any) -> str | None:
    """Why ``value`` (as YAML loaded it) cannot be of the plain type ``annotation``; ``None`` if it can or if the
    annotation is not a plain one (numbers, bool, str, Literal, Optional/Union of those, tensors)."""
    import torch

    members = _members(annotation)
    accepted = []
    for member in members:
        if member is type(None):
            accepted.append(value is None)
        elif member is bool:
            accepted.append(isinstance(value, bool))
        elif member is int:
            accepted.append(isinstance(value, int) and not isinstance(value, bool))
        elif member is float:
            accepted.append(isinstance(value, (int, float)) and not isinstance(value, bool))
        elif member is str:
            accepted.append(isinstance(value, str))
        elif typing.get_origin(member) is Literal:
            accepted.append(value in typing.get_args(member))
        elif member is torch.Tensor:
            accepted.append(isinstance(value, (int, float, list)) and not isinstance(value, bool))
        else:
            return None  # a type this check does not judge
    if any(accepted):
        return None
    names = []
    for member in members:
        if typing.get_origin(member) is Literal:
            names.append(" | ".join(repr(a) for a in typing.get_args(member)))
        else:
            names.append("null" if member is type(None) else getattr(member, "__name__", str(member)))
    return f"expected {' or '.join(names)}, got {value!r}"


# ------------------------------------------------------------------------------------------- the walk
def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _check_class(node: Any, prefix: str, sources: dict[str, str], problems: list[Problem]) -> None:
    """Check a ``{class_path, init_args}`` node (or a bare class path string) against the class's signature."""
    if isinstance(node, str) or not isinstance(node, dict):
        return
    cls = resolve_class(node.get("class_path"))
    if cls is None:
        return
    params = init_parameters(cls)
    hints = _hints(cls)
    args = dict(node.get("init_args") or {})
    for key, value in node.items():  # "--model.lr 1" is shorthand for init_args
        if key not in ("class_path", "init_args", "dict_kwargs", "__path__"):
            args[key] = value
    for key, value in args.items():
        where = f"{prefix}.init_args.{key}" if key in (node.get("init_args") or {}) else f"{prefix}.{key}"
        source = sources.get(where, sources.get(f"{prefix}.{key}", "configuration"))
        if key not in params:
            problems.append(Problem(where, f"unknown key: {cls.__name__} has no argument {key!r}"
                                    f"{_suggest(key, list(params))}", source))
            continue
        if isinstance(value, dict) and "class_path" in value:
            _check_class(value, where, sources, problems)
        elif key in hints:
            problem = type_problem(value, hints[key])
            if problem:
                problems.append(Problem(where, problem, source))


def check(args: list[str], trainer_class: type | None = None) -> list[Problem]:
    """Every unknown key and plainly mistyped value in ``args`` (the arguments after ``fit``)."""
    from lightning.pytorch import Trainer

    trainer_class = trainer_class or Trainer
    tree, sources = gather(args)
    problems: list[Problem] = []
    trainer_params = init_parameters(trainer_class)
    trainer_hints = _hints(trainer_class)
    for key, value in tree.items():
        source = sources.get(key, "configuration")
        if key in ("model", "data"):
            _check_class({"class_path": value} if isinstance(value, str) else value, key, sources, problems)
        elif key == "trainer" and isinstance(value, dict):
            for name, item in value.items():
                where = f"trainer.{name}"
                if name not in trainer_params:
                    problems.append(Problem(where, f"unknown key: Trainer has no argument {name!r}"
                                            f"{_suggest(name, list(trainer_params))}", sources.get(where, source)))
                elif isinstance(item, list):
                    for i, entry in enumerate(item):
                        _check_class(entry, f"{where}[{i}]", sources, problems)
                elif isinstance(item, dict):
                    _check_class(item, where, sources, problems)
                elif name in trainer_hints:
                    problem = type_problem(item, trainer_hints[name])
                    if problem:
                        problems.append(Problem(where, problem, sources.get(where, source)))
        elif key in _HINTS:
            problems.append(Problem(key, f"not accepted: {_HINTS[key]}", source))
        elif key not in _TOP_LEVEL:
            valid = sorted(_TOP_LEVEL | {"model", "data", "trainer"})
            problems.append(Problem(key, f"unknown key{_suggest(key, valid)}", source))
    return problems
