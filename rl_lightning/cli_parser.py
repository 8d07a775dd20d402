"""How the command line loads a configuration: ``trainer.callbacks`` of stacked configs and ``--trainer.callbacks+=``.

A stacked config's ``trainer.callbacks``, and ``--trainer.callbacks+=CLASS [--trainer.callbacks.KEY VALUE ...]``,
add to the callback list instead of replacing it; an entry of a class already in the list updates that entry
(``merge_callbacks``). So a task preset never drops the method config's callbacks, and
``--trainer.callbacks+=KLRegularizer --trainer.callbacks.beta 0.04`` turns on the KL penalty the configs carry.
``--trainer.callbacks=[...]`` still replaces the whole list.
"""

from __future__ import annotations

import difflib
import importlib
import json
import sys
from typing import Any

import yaml
from jsonargparse import Namespace

from rl_lightning.callbacks.compat import StackingParser

_CALLBACKS = "trainer.callbacks"
_SPEC_KEYS = ("class_path", "init_args", "dict_kwargs", "__path__")
#: where short class names (``--model GRPO``) are looked up, in order
_SHORT_NAME_MODULES = (
    "rl_lightning", "rl_lightning.algorithms", "rl_lightning.rollout", "rl_lightning.envs", "rl_lightning.callbacks",
    "torch.optim", "torch.optim.lr_scheduler", "lightning.pytorch.callbacks", "lightning.pytorch.loggers",
)


class ConfigParseError(Exception):
    """jsonargparse refused the command line or a config file (its message, unformatted)."""


class Parser(StackingParser):
    """The CLI's parser: no abbreviated options, errors raised (not printed), callback lists stacked."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # "--trainer.max_step 3" must not silently mean max_steps
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> Any:
        if not self.exit_on_error:  # jsonargparse's internal attempts expect its own exception
            return super().error(message, ex)
        raise ConfigParseError(message) from ex

    def parse_args(self, args: Any = None, *rest: Any, **kwargs: Any) -> Namespace:
        args = sys.argv[1:] if args is None else args
        self.last_args = list(args)  # the command line as given (class_switches reads it)
        return super().parse_args(callback_appends_as_configs(list(args)), *rest, **kwargs)

    def stack_config(self, cfg: dict[str, Any], before: Namespace) -> dict[str, Any]:
        trainer, earlier = cfg.get("trainer"), before.get(_CALLBACKS)
        if isinstance(trainer, dict) and isinstance(trainer.get("callbacks"), (list, dict)) and earlier:
            cfg = {**cfg, "trainer": {**trainer, "callbacks": merge_callbacks(earlier, trainer["callbacks"])[0]}}
        return cfg


# ------------------------------------------------------------------------------------------- callback lists
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
            current = _callback_entries(load_value(value))
            specs.append((len(out) + 1, current))
            out += ["--config", ""]
        elif current and isinstance(current[-1], dict) and key.startswith(f"--{_CALLBACKS}.") and has_value:
            if not isinstance(current[-1].get("init_args"), dict):
                current[-1]["init_args"] = {}
            node = current[-1]["init_args"]
            sub = key[len(f"--{_CALLBACKS}."):].removeprefix("init_args.").split(".")
            for part in sub[:-1]:
                node = node.setdefault(part, {})
            node[sub[-1]] = load_value(value)
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


def load_value(value: str) -> Any:
    """A command-line value as YAML reads it (``0.01`` a number, ``[a, b]`` a list), else the string."""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


# ------------------------------------------------------------------------------------------- class paths
def suggest(key: str, valid: list[str]) -> str:
    """`` (did you mean X?)`` for the name in ``valid`` closest to ``key``, else ``""``."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _public_classes(module: Any) -> list[str]:
    return [n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_")]


def lookup(name: str) -> tuple[Any, str | None]:
    """What the dotted path ``name`` names, or ``(None, why not)``."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 -- any failure to import is the user's to see
        why = str(err) if isinstance(err, ImportError) else f"{type(err).__name__}: {err}"
        return None, f"cannot import {name} ({why})"
    if not hasattr(module, attr):
        return None, f"no class {attr} in module {module_name}{suggest(attr, _public_classes(module))}"
    return getattr(module, attr), None


def find_class(name: Any) -> tuple[type | None, str | None]:
    """``(class, None)`` for the class a ``class_path`` names (a dotted path, or a short name exported by a known
    module), else ``(None, why not)``: ``cannot import X (No module named 'mypkg')`` or ``no class X in module Y
    (did you mean Z?)``; ``(None, None)`` for a value that is not a string."""
    if not isinstance(name, str) or not name:
        return None, None
    if "." in name:
        found, why = lookup(name)
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
        known += _public_classes(module)
    return None, f"no class named {name}{suggest(name, known)}"


def resolve_class(name: Any) -> type | None:
    """The class a ``class_path`` names, or ``None`` (``find_class`` says why)."""
    return find_class(name)[0]


# ------------------------------------------------------------------------------------------- class switches
def _config_layers(args: list[str]) -> list[tuple[str, Any]]:
    """The command line as ordered layers: ``("config", dict)`` for each ``--config`` (file or inline YAML/JSON),
    ``("arg", (dotted key, value))`` for each other ``--key value``."""
    layers: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            i += 1
            continue
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                i += 1
                continue
            value, i = args[i + 1], i + 1
        i += 1
        if key in ("config", "c"):
            try:
                text = open(value).read() if not value.lstrip().startswith(("{", "[")) else value
                loaded = yaml.safe_load(text)
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(loaded, dict):
                layers.append(("config", loaded))
        else:
            layers.append(("arg", (key, value)))
    return layers


def class_switches(args: list[str], final: dict[str, Any]) -> list[str]:
    """One line per class switch along the command line (a later config or ``--model NewClass`` giving another
    ``class_path`` at the same place) whose carried-over settings differ from the new class's defaults: values set
    for the earlier class, never set again after the switch, that the new class accepted (jsonargparse keeps them).
    ``final`` is the parsed configuration (a dict)."""
    state: dict[str, tuple[str, set[str]]] = {}  # path -> (class_path, keys set for it)
    switched: dict[str, tuple[str, str, set[str]]] = {}  # path -> (first class, last class, carried keys)

    def set_class(path: str, cls: str) -> None:
        old = state.get(path)
        if old is not None and resolve_class(old[0]) is not resolve_class(cls):
            first = switched.get(path, (old[0], cls, set()))
            switched[path] = (first[0], cls, first[2] | old[1])
            state[path] = (cls, set())
        elif old is None:
            state[path] = (cls, set())

    def set_key(path: str, key: str) -> None:
        if path in state:
            state[path][1].add(key)
        if path in switched:
            switched[path][2].discard(key)

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        if isinstance(node.get("class_path"), str):
            set_class(path, node["class_path"])
            for key, value in (node.get("init_args") or {}).items():
                set_key(path, key)
                walk(value, f"{path}.init_args.{key}")
            return
        for key, value in node.items():
            walk(value, f"{path}.{key}" if path else key)

    for kind, layer in _config_layers(args):
        if kind == "config":
            walk(layer, "")
            continue
        key, value = layer
        if key.endswith(".class_path"):
            set_class(key[: -len(".class_path")], value)
        elif key in state or (key in ("model", "data") and ("." in value or value[:1].isupper())):
            set_class(key, value)
        elif ".init_args." in key:
            path, _, rest = key.rpartition(".init_args.")
            set_key(path, rest.split(".")[0])
        else:
            path, _, name = key.rpartition(".")
            if path in state:
                set_key(path, name)
    lines = []
    for path, (first, last, carried) in switched.items():
        node: Any = final
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        cls = resolve_class(node.get("class_path")) if isinstance(node, dict) else None
        if cls is None or not carried:
            continue
        init_args = node.get("init_args") or {}
        defaults = _defaults(cls)
        plain = (bool, int, float, str, type(None), list, tuple)  # a nested class spec is its own object's
        differ = [f"{k}={init_args[k]!r} (default {defaults[k]!r})" for k in sorted(carried)
                  if k in init_args and k in defaults and isinstance(init_args[k], plain)
                  and isinstance(defaults[k], plain) and init_args[k] != defaults[k]]
        if differ:
            lines.append(f"{path}: {first.rsplit('.', 1)[-1]} -> {cls.__name__} keeps the earlier class's "
                         f"{', '.join(differ)}; set them for {cls.__name__} if they are not meant "
                         "(docs/extending_advanced.md#switching-a-class)")
    return lines


def _defaults(cls: type) -> dict[str, Any]:
    """The constructor defaults of ``cls`` and of the classes it passes ``**kwargs`` to (its bases)."""
    import inspect

    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):
            continue
        out.update({n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty})
    return out
