"""Find every unknown key, plainly mistyped value and class path that does not import, with the file and line it
came from; and merge the ``trainer.callbacks`` of stacked configs.

``jsonargparse`` stops at the first problem and wraps it in a dozen lines about union subtypes. When it refuses a
configuration, the CLI runs ``check`` over the same sources (the ``--config`` files in order, then the
command-line overrides) to list every problem on one line each: ``configs/grpo.yaml:12: model.init_args.lr_rate:
unknown key (did you mean ...?)``, ``command line: model.class_path: no class GRP0 in module
rl_lightning.algorithms (did you mean GRPO?)``. The check knows the classes' signatures only; anything it cannot
judge it leaves to jsonargparse's own message.

``merge_callbacks`` and ``callback_appends_as_configs`` define how a stacked config and ``--trainer.callbacks+=``
change the callback list (the CLI's parser applies them; ``gather`` follows them): entries are added, and an entry
of a class already in the list updates that one.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import re
import types
import typing
from collections import abc
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
    value: Any = None  # the value given, for an unknown key

    def __str__(self) -> str:
        return f"{self.source}: {self.key}: {self.message}"


# ------------------------------------------------------------------------------------------- gathering the sources
def _yaml_lines(text: str) -> dict[str, int]:
    """Dotted key -> 1-based line of every mapping key in a YAML text (list items as ``key[i]``)."""
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
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, "")
    return lines


def _set(tree: dict[str, Any], dotted: str, value: Any) -> str:
    """Set a command-line key as jsonargparse does (a key below a list sets its last item); returns the key with
    the list index it went to (``trainer.callbacks[2].init_args.beta``)."""
    parts = dotted.split(".")
    node = tree
    concrete = []
    for part in parts[:-1]:
        child = node.get(part)
        if isinstance(child, list) and child and isinstance(child[-1], (str, dict)):
            if isinstance(child[-1], str):
                child[-1] = {"class_path": child[-1]}
            concrete.append(f"{part}[{len(child) - 1}]")
            node = child[-1]
            continue
        if isinstance(child, str):  # "--model GRPO" then "--model.init_args.x": the string is the class path
            child = {"class_path": child}
        if not isinstance(child, dict):
            child = {}
        node[part] = child
        node = child
        concrete.append(part)
    node[parts[-1]] = value
    return ".".join([*concrete, parts[-1]])


def _discard_init_args(tree: dict[str, Any], prefix: str, class_path: Any) -> None:
    """``--model.class_path X`` over a config's model: jsonargparse drops the init_args that ``X`` does not take."""
    node: Any = tree
    for part in prefix.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    cls = resolve_class(class_path)
    if isinstance(node, dict) and node.get("class_path") != class_path and cls is not None:
        params = init_parameters(cls)
        node["init_args"] = {k: v for k, v in (node.get("init_args") or {}).items() if k in params}


# ------------------------------------------------------------------------------------------- stacked callbacks
_CALLBACKS = "trainer.callbacks"
_SPEC_KEYS = ("class_path", "init_args", "dict_kwargs", "__path__")


def _callback_entries(value: Any) -> list[Any]:
    items = value if isinstance(value, list) else [value]
    items = [item.as_dict() if hasattr(item, "as_dict") else item for item in items]  # jsonargparse Namespaces
    return [{"class_path": item} if isinstance(item, str) else item for item in items]


def _init_args(entry: dict[str, Any]) -> dict[str, Any]:
    """A callback entry's settings: its ``init_args`` and the shorthand keys beside ``class_path``."""
    return {**(entry.get("init_args") or {}), **{k: v for k, v in entry.items() if k not in _SPEC_KEYS}}


def merge_callbacks(base: Any, extra: Any) -> tuple[list[Any], dict[int, int]]:
    """``trainer.callbacks`` of a stacked config added to the list before it.

    An entry whose class is already in the list updates that entry in place (the settings it gives replace the
    earlier ones, the others stay); any other entry is appended. Returns the list and the index each entry of
    ``extra`` went to.
    """
    merged = [{k: v for k, v in e.items() if k != "__path__"} if isinstance(e, dict) else e
              for e in (_callback_entries(base) if base is not None else [])]
    updated: set[int] = set()
    positions: dict[int, int] = {}
    for j, entry in enumerate(_callback_entries(extra)):
        cls = resolve_class(entry.get("class_path")) if isinstance(entry, dict) else None
        match = next((i for i, old in enumerate(merged) if i not in updated and cls is not None
                      and isinstance(old, dict) and resolve_class(old.get("class_path")) is cls), None)
        if match is None:
            merged.append(entry)
            match = len(merged) - 1
        else:
            merged[match] = {"class_path": merged[match]["class_path"],
                             "init_args": {**_init_args(merged[match]), **_init_args(entry)}}
        updated.add(match)
        positions[j] = match
    return merged, positions


def callback_appends_as_configs(args: list[str]) -> list[str]:
    """``--trainer.callbacks+=CLASS [--trainer.callbacks.KEY VALUE ...]`` as one stacked config
    (``--config '{"trainer": {"callbacks": [...]}}'``), so that it follows ``merge_callbacks``: a callback of a
    class already in the list (``KLRegularizer``) updates that one instead of adding a second."""
    out: list[str] = []
    specs: list[tuple[int, list[Any]]] = []  # (index in out, the entries appended there)
    current: list[Any] | None = None  # the entries that --trainer.callbacks.KEY sets now
    i = 0
    while i < len(args):
        key, eq, value = args[i].partition("=")
        has_value = bool(eq) or (i + 1 < len(args) and not args[i + 1].startswith("--"))
        value = value if eq else args[i + 1] if has_value else ""
        if key == f"--{_CALLBACKS}+" and has_value:
            current = _callback_entries(_load(value))
            specs.append((len(out) + 1, current))
            out += ["--config", ""]
        elif current and isinstance(current[-1], dict) and key.startswith(f"--{_CALLBACKS}.") and has_value:
            if not isinstance(current[-1].get("init_args"), dict):
                current[-1]["init_args"] = {}
            node = current[-1]["init_args"]
            sub = key[len(f"--{_CALLBACKS}."):].removeprefix("init_args.").split(".")
            for part in sub[:-1]:
                node = node.setdefault(part, {})
            node[sub[-1]] = _load(value)
        else:
            if key in (f"--{_CALLBACKS}", "--config", "-c"):  # the list is replaced or restacked from here on
                current = None
            out.append(args[i])
            i += 1
            continue
        i += 1 if eq else 2
    for index, entries in specs:
        out[index] = json.dumps({"trainer": {"callbacks": entries}})
    return out


def _load(value: str) -> Any:
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _merge(base: dict[str, Any], extra: dict[str, Any], prefix: str = "",
           positions: dict[int, int] | None = None) -> dict[str, Any]:
    for key, value in extra.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if dotted == _CALLBACKS and isinstance(value, (list, dict)) and base.get(key) is not None:
            base[key], moved = merge_callbacks(base[key], value)
            if positions is not None:
                positions.update(moved)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            same_class = value.get("class_path") in (None, base[key].get("class_path"))
            base[key] = _merge(base[key], value, dotted, positions) if same_class else value
        else:
            base[key] = value
    return base


def _moved(dotted: str, positions: dict[int, int]) -> str:
    """A stacked config's ``trainer.callbacks[j]...`` key at the index the entry went to in the merged list."""
    match = re.match(r"trainer\.callbacks\[(\d+)\]", dotted)
    if match is None or int(match.group(1)) not in positions:
        return dotted
    return f"{_CALLBACKS}[{positions[int(match.group(1))]}]{dotted[match.end():]}"


def gather(args: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The merged configuration of ``args`` (after the subcommand) and where each dotted key came from."""
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    args = callback_appends_as_configs(args)
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
            try:
                text, path = Path(value).read_text(), value
            except OSError:  # not a file: a configuration given as a string
                text, path = value, None
            try:
                loaded = yaml.safe_load(text) or {}
            except yaml.YAMLError:
                continue
            if isinstance(loaded, dict):
                positions: dict[int, int] = {}
                tree = _merge(tree, loaded, positions=positions)
                for dotted, line in _yaml_lines(text).items():
                    sources[_moved(dotted, positions)] = f"{path}:{line}" if path else "command line"
            continue
        target = key.rstrip("+")
        parsed = _load(value)
        if target.endswith(".class_path"):
            _discard_init_args(tree, target[: -len(".class_path")], parsed)
        concrete = _set(tree, target, parsed)
        for stale in [k for k in sources if k.startswith((f"{concrete}.", f"{concrete}["))]:
            del sources[stale]  # "--model GRPO" replaces the file's model: its keys no longer come from there
        sources[concrete] = "command line"
    return tree, sources


# ------------------------------------------------------------------------------------------- classes and types
def _lookup(name: str) -> tuple[Any, str | None]:
    """What the dotted path ``name`` names, or ``(None, why not)``."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 -- any failure to import is the user's to see
        why = str(err) if isinstance(err, ImportError) else f"{type(err).__name__}: {err}"
        return None, f"cannot import {name} ({why})"
    if not hasattr(module, attr):
        classes = [n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_")]
        return None, f"no class {attr} in module {module_name}{_suggest(attr, classes)}"
    return getattr(module, attr), None


def find_class(name: Any) -> tuple[type | None, str | None]:
    """``(class, None)`` for the class a ``class_path`` names (a dotted path, or a short name exported by a known
    module), else ``(None, why not)``: ``cannot import X (No module named 'mypkg')`` or ``no class X in module Y
    (did you mean Z?)``; ``(None, None)`` for a value that is not a string."""
    if not isinstance(name, str) or not name:
        return None, None
    if "." in name:
        found, why = _lookup(name)
        if why is None and not isinstance(found, type):
            why = f"{name} is not a class"
        return (found, None) if why is None else (None, why)
    known: list[str] = []
    for module_name in _SHORT_NAME_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001
            continue
        found = getattr(module, name, None)
        if isinstance(found, type):
            return found, None
        known += [n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_")]
    return None, f"no class named {name}{_suggest(name, known)}"


def resolve_class(name: Any) -> type | None:
    """The class a ``class_path`` names, or ``None`` (``find_class`` says why)."""
    return find_class(name)[0]


def _signature_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The ``__init__`` parameters of every class along the MRO, following ``**kwargs`` up the hierarchy."""
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


def init_parameters(cls: type) -> dict[str, Any]:
    """The ``__init__`` parameters a class accepts, as jsonargparse resolves them: along ``**kwargs`` up the MRO,
    less those a subclass passes itself (``super().__init__(scale_rewards=False, **kwargs)``)."""
    params = _signature_parameters(cls)
    try:
        from jsonargparse._parameter_resolvers import get_signature_parameters

        accepted = {p.name for p in get_signature_parameters(cls, "__init__")}
    except Exception:  # noqa: BLE001 -- jsonargparse's resolver is private API: fall back to the plain walk
        return params
    return {name: param for name, param in params.items() if name in accepted}


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


def _takes_class_path(annotation: Any) -> bool:
    """Whether a string for ``annotation`` is read as an import path: it admits a class (or a callable) but not
    a string."""
    import torch

    plain = (bool, int, float, str, type(None), torch.Tensor)
    members = _members(annotation)
    if any(m is str or typing.get_origin(m) is Literal for m in members):
        return False
    return any((isinstance(m, type) and m not in plain) or typing.get_origin(m) is abc.Callable for m in members)


def _check_class_path(name: str, annotation: Any, where: str, source: str, problems: list[Problem]) -> None:
    """A bare import path given for a class-typed argument (``--data.init_args.reward_fn mypkg.MyReward``)."""
    if any(typing.get_origin(m) is abc.Callable for m in _members(annotation)):
        why = _lookup(name)[1] if "." in name else None  # a function is a callable too
    else:
        why = find_class(name)[1]
    if why:
        problems.append(Problem(where, why, source))


def _check_class(node: Any, prefix: str, sources: dict[str, str], problems: list[Problem]) -> None:
    """Check a ``{class_path, init_args}`` node (or a bare class path string) against the class's signature."""
    if isinstance(node, str):
        node = {"class_path": node}
    if not isinstance(node, dict):
        return
    cls, why = find_class(node.get("class_path"))
    if cls is None:
        if why:
            where = f"{prefix}.class_path"
            problems.append(Problem(where, why, sources.get(where, sources.get(prefix, "configuration"))))
        return
    params = init_parameters(cls)
    hints = _hints(cls)
    args = dict(node.get("init_args") or {})
    for key, value in node.items():  # "--model.lr 1" is shorthand for init_args
        if key not in ("class_path", "init_args", "dict_kwargs", "__path__"):
            args[key] = value
    for key, value in args.items():
        where = f"{prefix}.init_args.{key}" if key in (node.get("init_args") or {}) else f"{prefix}.{key}"
        source = sources.get(where, sources.get(f"{prefix}.{key}", sources.get(prefix, "configuration")))
        if key not in params:
            itself = f" ({cls.__name__} sets it itself)" if key in _signature_parameters(cls) else ""
            problems.append(Problem(where, f"unknown key: {cls.__name__} has no argument {key!r}"
                                    f"{itself or _suggest(key, list(params))}", source, value))
            continue
        if isinstance(value, dict) and "class_path" in value:
            _check_class(value, where, sources, problems)
        elif key in hints and isinstance(value, str) and _takes_class_path(hints[key]):
            _check_class_path(value, hints[key], where, source, problems)
        elif key in hints:
            problem = type_problem(value, hints[key])
            if problem:
                problems.append(Problem(where, problem, source))


def _last_callback_hint(problem: Problem, callbacks: list[Any]) -> Problem:
    """A command-line ``--trainer.callbacks.KEY`` sets the list's last callback: name the one that takes ``KEY``."""
    last = f"{_CALLBACKS}[{len(callbacks) - 1}]."
    key = problem.key.removeprefix(last).removeprefix("init_args.")
    if problem.source != "command line" or not problem.key.startswith(last) or "." in key:
        return problem
    takers = [cls.__name__ for entry in callbacks[:-1] if isinstance(entry, dict)
              for cls in [resolve_class(entry.get("class_path"))] if cls is not None and key in init_parameters(cls)]
    if not takers:
        return problem
    value = problem.value if isinstance(problem.value, str) else json.dumps(problem.value)  # 0.01 -> "0.01"
    return Problem(problem.key, f"{problem.message}; --{_CALLBACKS}.{key} sets the last callback of the list; to "
                   f"set {takers[0]}'s: --{_CALLBACKS}+={takers[0]} --{_CALLBACKS}.{key} {value}", problem.source)


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
                    found = len(problems)
                    for i, entry in enumerate(item):
                        if isinstance(entry, dict) or name == "callbacks":
                            _check_class(entry, f"{where}[{i}]", sources, problems)
                    if name == "callbacks":
                        problems[found:] = [_last_callback_hint(p, item) for p in problems[found:]]
                elif isinstance(item, dict):
                    _check_class(item, where, sources, problems)
                elif name in trainer_hints and isinstance(item, str) and _takes_class_path(trainer_hints[name]):
                    _check_class_path(item, trainer_hints[name], where, sources.get(where, source), problems)
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
