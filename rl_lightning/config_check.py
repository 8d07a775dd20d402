"""The one line for a refused configuration: every unknown key and bad class path at once, each with its file:line.

jsonargparse stops at the first problem, does not say which file and line it came from, and wraps it in a dozen
lines about union subtypes. When it refuses a configuration, ``error_line`` runs ``check`` over the same sources
(the ``--config`` files in order, then the command-line overrides, stacked as the CLI's parser stacks them) and
lists, one each, what jsonargparse does not report that way:

* every unknown key, with the closest valid name: ``configs/grpo.yaml:12: model.init_args.clip_eps_lo: unknown
  key: GRPO has no argument 'clip_eps_lo' (did you mean clip_eps_low?)``;
* every class path that does not import, with the closest class: ``command line: model.class_path: no class GRP0
  in module rl_lightning.algorithms (did you mean GRPO?)``.

Anything else (a wrong type, a value out of range) is jsonargparse's own message, cut to its innermost cause under
the full key, with the file and line that key came from: ``configs/x.yaml:3: data.init_args.group_size: Expected
a <class 'int'>. Got value: many``. Which arguments a class takes is read with jsonargparse's own resolver
(``compat.signature_parameters``), so the check accepts exactly what jsonargparse accepts.
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from collections import abc
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from rl_lightning.cli_parser import (
    _CALLBACKS, _SPEC_KEYS, callback_appends_as_configs, find_class, load_value, lookup, merge_callbacks,
    resolve_class, suggest,
)
from rl_lightning.callbacks.compat import signature_parameters

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


def error_line(message: str, args: list[str]) -> str:
    """One line for a configuration jsonargparse refused with ``message``: every problem ``check`` finds in
    ``args`` (the command line, its subcommand first), else jsonargparse's innermost cause, located."""
    args = args[1:] if args and not args[0].startswith("-") else args
    problems = check(args)
    if problems:
        return "; ".join(str(p) for p in problems)
    chain, cause = _jsonargparse_gist(message)
    if not chain:
        return cause
    tree, sources = gather(args)
    key = _dotted(chain, tree)
    shorthand = key.replace(".init_args.", ".")
    source = sources.get(key) or sources.get(shorthand)
    value = next((v for v in (_value_at(tree, key), _value_at(tree, shorthand)) if v is not None), None)
    given = f". Got value: {value}" if value is not None and "Got value" not in cause else ""
    return f"{source + ': ' if source else ''}{key}: {cause}{given}"


def _value_at(tree: dict[str, Any], key: str, leaf: bool = True) -> Any:
    """The value at a dotted key (``trainer.callbacks[0].init_args.beta``); with ``leaf``, ``None`` for a
    mapping or a list."""
    node: Any = tree
    for part in key.split("."):
        name, _, index = part.partition("[")
        node = node.get(name) if isinstance(node, dict) else None
        if index and isinstance(node, list) and int(index[:-1]) < len(node):
            node = node[int(index[:-1])]
    return None if leaf and isinstance(node, (dict, list)) else node


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
        params = signature_parameters(cls)
        node["init_args"] = {k: v for k, v in (node.get("init_args") or {}).items() if k in params}


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
        parsed = load_value(value)
        if target.endswith(".class_path"):
            _discard_init_args(tree, target[: -len(".class_path")], parsed)
        concrete = _set(tree, target, parsed)
        for stale in [k for k in sources if k.startswith((f"{concrete}.", f"{concrete}["))]:
            del sources[stale]  # "--model GRPO" replaces the file's model: its keys no longer come from there
        sources[concrete] = "command line"
    return tree, sources


# ------------------------------------------------------------------------------------------- the walk
def _members(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _settings_group(annotation: Any) -> type | None:
    """The dataclass a parameter annotated ``annotation`` takes (a settings group, read as a mapping of its
    fields: ``RolloutDataModule``'s ``sampling``), else ``None``."""
    groups = [m for m in _members(annotation) if isinstance(m, type) and is_dataclass(m)]
    return groups[0] if groups else None


def _in_a_group(key: str, params: dict[str, Any], where: str) -> str:
    """`` (it is a field of a settings group now: data.init_args.sampling.sync_interval?)`` where ``key`` names a
    field of one of the class's settings groups: the field itself, a field with a prefix (``sampler_sync_interval``
    for ``sync_interval``) or a close name; else ``""``."""
    found = []
    for name, annotation in params.items():
        group = _settings_group(annotation)
        for field_name in [f.name for f in fields(group)] if group is not None else []:
            close = difflib.SequenceMatcher(None, key, field_name).ratio() >= 0.8
            if key == field_name or key.endswith("_" + field_name) or close:
                found.append(f"{where}.{name}.{field_name}")
    return f" (a field of a settings group: did you mean {found[0]}?)" if found else ""


def _takes_class_path(annotation: Any) -> bool:
    """Whether a string for ``annotation`` is read as an import path: it admits a class (or a callable) but not
    a string."""
    import torch

    plain = (bool, int, float, str, type(None), torch.Tensor)
    members = _members(annotation)
    if any(m is str or typing.get_origin(m) is Literal for m in members):
        return False
    return any((isinstance(m, type) and m not in plain) or typing.get_origin(m) is abc.Callable for m in members)


def _source(sources: dict[str, str], *keys: str) -> str:
    return next((sources[k] for k in keys if k in sources), "configuration")


class _Walk:
    """Every unknown key and bad class path of a gathered configuration, against the classes it names."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.sources = sources
        self.problems: list[Problem] = []

    def node(self, node: Any, prefix: str) -> None:
        """A ``{class_path, init_args}`` node (or a bare class path string)."""
        if isinstance(node, str):
            node = {"class_path": node}
        if not isinstance(node, dict):
            return
        cls, why = find_class(node.get("class_path"))
        if cls is None:
            if why:
                where = f"{prefix}.class_path"
                self.problems.append(Problem(where, why, _source(self.sources, where, prefix)))
            return
        init_args = node.get("init_args") or {}
        shorthand = {k: v for k, v in node.items() if k not in _SPEC_KEYS}  # "--model.lr 1" means init_args
        self.arguments(cls, {**init_args, **shorthand}, prefix, set(init_args))

    def arguments(self, cls: type, args: dict[str, Any], prefix: str, under_init_args: set[str]) -> None:
        params = signature_parameters(cls)
        for key, value in args.items():
            where = f"{prefix}.init_args.{key}" if key in under_init_args else f"{prefix}.{key}"
            source = _source(self.sources, where, f"{prefix}.{key}", prefix)
            if key not in params:
                itself = any(key in signature_parameters(base) for base in cls.__mro__[1:-1])
                why = (f" ({cls.__name__} sets it itself)" if itself else
                       _in_a_group(key, params, where.rpartition(".")[0]) or suggest(key, list(params)))
                self.problems.append(Problem(where, f"unknown key: {cls.__name__} has no argument {key!r}{why}",
                                             source, value))
            elif isinstance(value, dict) and (group := _settings_group(params[key])) is not None:
                names = [f.name for f in fields(group)]
                for field_name, field_value in value.items():
                    if field_name not in names:
                        self.problems.append(Problem(
                            f"{where}.{field_name}", f"unknown key: {group.__name__} has no field {field_name!r}"
                            f"{suggest(field_name, names)}", _source(self.sources, f"{where}.{field_name}",
                                                                    f"{prefix}.{key}.{field_name}", prefix),
                            field_value))
            elif isinstance(value, dict) and "class_path" in value:
                self.node(value, where)
            elif isinstance(value, list):  # callbacks, loggers, plugins: the entries that name a class
                for i, entry in enumerate(value):
                    if isinstance(entry, dict) or (isinstance(entry, str) and _takes_class_path(params[key])):
                        self.node(entry, f"{where}[{i}]")
            elif isinstance(value, str) and _takes_class_path(params[key]):
                callable_ = any(typing.get_origin(m) is abc.Callable for m in _members(params[key]))
                # a callable may be a function, which find_class refuses
                why = (lookup(value)[1] if "." in value else None) if callable_ else find_class(value)[1]
                if why:
                    self.problems.append(Problem(where, why, source))


def _last_callback_hint(problem: Problem, callbacks: list[Any]) -> Problem:
    """A command-line ``--trainer.callbacks.KEY`` sets the list's last callback: name the one that takes ``KEY``."""
    last = f"{_CALLBACKS}[{len(callbacks) - 1}]."
    key = problem.key.removeprefix(last).removeprefix("init_args.")
    if problem.source != "command line" or not problem.key.startswith(last) or "." in key:
        return problem
    classes = [resolve_class(entry.get("class_path")) for entry in callbacks[:-1] if isinstance(entry, dict)]
    takers = [cls.__name__ for cls in classes if cls is not None and key in signature_parameters(cls)]
    if not takers:
        return problem
    value = problem.value if isinstance(problem.value, str) else json.dumps(problem.value)  # 0.01 -> "0.01"
    return Problem(problem.key, f"{problem.message}; --{_CALLBACKS}.{key} sets the last callback of the list; to "
                   f"set {takers[0]}'s: --{_CALLBACKS}+={takers[0]} --{_CALLBACKS}.{key} {value}", problem.source)


def check(args: list[str]) -> list[Problem]:
    """Every unknown key and bad class path in ``args`` (the arguments after ``fit``)."""
    from lightning.pytorch import Trainer

    tree, sources = gather(args)
    walk = _Walk(sources)
    for key, value in tree.items():
        if key in ("model", "data"):
            walk.node(value, key)
        elif key == "trainer" and isinstance(value, dict):
            walk.arguments(Trainer, value, "trainer", set())
        elif key in _HINTS:
            walk.problems.append(Problem(key, f"not accepted: {_HINTS[key]}", _source(sources, key)))
        elif key not in _TOP_LEVEL:
            valid = sorted(_TOP_LEVEL | {"model", "data", "trainer"})
            walk.problems.append(Problem(key, f"unknown key{suggest(key, valid)}", _source(sources, key)))
    callbacks = (tree.get("trainer") or {}).get("callbacks") if isinstance(tree.get("trainer"), dict) else None
    if isinstance(callbacks, list):
        return [_last_callback_hint(p, callbacks) for p in walk.problems]
    return walk.problems


# ------------------------------------------------------------------------------------------- jsonargparse's message
#: jsonargparse's lines about the union it tried, not about the problem
_UNION_NOISE = re.compile(r"(Does not validate against any|Subtypes:|Errors:|Given value|Expected a <class 'NoneType'>|"
                          r"Expected a path but|Problem with given class_path)")
#: causes that only say an alternative of a union did not fit either, shown when nothing else is said
_ALTERNATIVE = re.compile(r"Expected a dot import path string")


def _jsonargparse_gist(message: str) -> tuple[list[tuple[str, str | None]], str]:
    """``(keys, cause)`` from jsonargparse's nested message: the innermost causes, under the chain of keys
    (``Parser key "data"`` > ``"task"`` > ``"operations"``), each with the class it was tried as, if any."""
    lines = [(len(line) - len(line.lstrip()), line.strip().removeprefix("- ").strip())
             for line in message.splitlines() if line.strip()]
    keys: list[tuple[int, str, str | None]] = []  # the open "Parser key" chain: (indent, key, class path)
    causes: list[tuple[int, list[tuple[str, str | None]], str]] = []  # (indent, keys above it, text)
    for indent, text in lines:
        keys = [k for k in keys if k[0] < indent]
        key = re.search(r'Parser key "([^"]+)"', text)  # also "... expects a callable class: Parser key "lr":"
        tried = re.match(r"Problem with given class_path '([^']+)'", text)
        if key:
            keys.append((indent, key.group(1), None))
        elif tried and keys:
            keys[-1] = (*keys[-1][:2], tried.group(1))
        elif text and not _UNION_NOISE.match(text):
            causes.append((indent, [(k, c) for _, k, c in keys], text))
    if not causes:
        return [], lines[0][1] if lines else message
    depth = max(indent for indent, _, _ in causes)
    chain = next(chain for indent, chain, _ in causes if indent == depth)
    nested = re.search(r"NestedArg\(key='([^']+)'", message)
    if len(chain) == 1 and nested:
        chain = [*chain, (nested.group(1), None)]
    texts = list(dict.fromkeys(text for indent, _, text in causes if indent == depth))
    texts = [t for t in texts if not _ALTERNATIVE.match(t)] or texts
    return chain, "; ".join(texts)


def _dotted(chain: list[tuple[str, str | None]], tree: dict[str, Any]) -> str:
    """The full key of a chain (``data.init_args.task.init_args.operations``); a list entry by its index, the
    entry of the class jsonargparse tried (``trainer.callbacks[0].init_args.target``)."""
    path = ""
    for key, class_path in chain:
        path += key if not path else f".{key}" if key.startswith(("init_args", "class_path")) else f".init_args.{key}"
        entries = _value_at(tree, path, leaf=False)
        if isinstance(entries, list) and class_path is not None:
            cls = resolve_class(class_path)
            index = next((i for i, entry in enumerate(entries) if isinstance(entry, dict)
                          and resolve_class(entry.get("class_path")) is cls), None)
            path += "" if index is None else f"[{index}]"
    return path
