"""Config loading: a YAML file plus dotted command-line overrides into frozen dataclasses.

    cfg = load_config(SimloopConfig, "configs/demo_cpu.yaml", ["--agent.model.num_layers", "4"])

Order of precedence: the dataclass defaults, then the file, then the overrides. A section typed
`ModelConfig` also accepts `preset: NAME` (tiny, qwen3_0p6b, ...), whose fields sit between the
defaults and the file's other keys. draccus converts and type-checks the values and each
dataclass's `__post_init__` validates them; the glue here is what draccus lacks: sections merge
over their field's default (which may differ from the class's, e.g. `RoleConfig.model = tiny()`),
presets, unknown keys that name the allowed ones, and one-line `ConfigError`s. A field typed
`dict[str, SomeConfig]` (`env.terminal.shaping`) takes a mapping whose values are sections,
each merged over the class's defaults. Imports no JAX.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import draccus
import yaml
from draccus.utils import DecodingError, DraccusException

from rl.data.rundir import CONFIG, is_writer, lock_run_dir
from rl.model.config import PRESETS, ModelConfig, preset

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key, value and what is
    allowed."""


def parse_overrides(args: Sequence[str]) -> list[tuple[str, Any]]:
    """`["--a.b", "1", "--c=x"]` -> `[("a.b", 1), ("c", "x")]`; values are parsed as YAML."""
    out: list[tuple[str, Any]] = []
    rest = iter(args)
    for arg in rest:
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides look like --section.key VALUE"
            )
        key, eq, text = arg[2:].partition("=")
        if not eq and (text := next(rest, None)) is None:
            raise ConfigError(f"override --{key} has no value")
        try:
            out.append((key, yaml.safe_load(text) if text else ""))
        except yaml.YAMLError as e:
            raise ConfigError(f"override --{key}={text!r} is not a valid YAML value: {e}") from e
    return out


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    *sections, last = key.split(".")
    for depth, part in enumerate(sections):
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            where = ".".join(sections[: depth + 1])
            raise ConfigError(f"override --{key}: '{where}' is a value, not a section")
    tree[last] = value


def _merge(default: Any, user: Any, prefix: str) -> dict[str, Any]:
    """`user` over the dataclass instance `default` as a plain tree for draccus to decode, with
    its keys checked and a `preset` expanded; nested sections merge over their own defaults.
    `prefix` is the section's dotted path for messages ("" or "agent.model.")."""
    cls = type(default)
    if not isinstance(user, Mapping):
        where = prefix[:-1] or "the config"
        raise ConfigError(f"'{where}' must be a mapping of {cls.__name__} fields, got {user!r}")
    user = dict(user)
    allowed = sorted(f.name for f in dataclasses.fields(cls) if f.init)
    if cls is ModelConfig:
        allowed.append("preset")
        if "preset" in user:
            name = user.pop("preset")
            if name not in PRESETS:
                raise ConfigError(f"'{prefix}preset'={name!r} is invalid: one of {sorted(PRESETS)}")
            default = preset(name)
    for key in user:
        if key not in allowed:
            raise ConfigError(
                f"unknown key '{prefix}{key}' in {cls.__name__}: allowed keys are {allowed}"
            )
    tree = draccus.encode(default)
    for key, value in user.items():
        sub = getattr(default, key)
        if dataclasses.is_dataclass(sub) and value is not None:
            tree[key] = _merge(sub, value, f"{prefix}{key}.")
        elif isinstance(value, Mapping) and (item := _section_values(cls, key)) is not None:
            tree[key] = {k: _merge(item(), v, f"{prefix}{key}.{k}.") for k, v in value.items()}
        else:
            tree[key] = value
    return tree


def _section_values(cls: type, name: str) -> type | None:
    """The config class of the values of a `dict[str, SomeConfig]` field, else None."""
    tp = typing.get_type_hints(cls)[name]
    args = typing.get_args(tp)
    if typing.get_origin(tp) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return args[1]
    return None


def _one_line(e: DecodingError, cls: type, tree: Any) -> str:
    """draccus's message, or for its multi-line ones (a list given a string, a union) the value
    found at the error's key path and the type that was expected there."""
    if "\n" not in e.message:
        return e.message
    tp, value = cls, tree
    try:
        for part in e.key_path:
            if dataclasses.is_dataclass(tp):
                tp = typing.get_type_hints(tp)[part]
            else:  # a list's item, a dict's value
                tp = [a for a in typing.get_args(tp) if a is not type(None)][-1]
            value = value[int(part)] if isinstance(value, list) else value[part]
    except (LookupError, ValueError, TypeError):
        return " ".join(e.message.split())
    expected = tp.__name__ if type(tp) is type else str(tp).replace("typing.", "")
    return f"got {value!r}, expected {expected}"


def _no_bools_for_numbers(cls: type, tree: Mapping[str, Any], prefix: str) -> None:
    """YAML's `true` where a number belongs: draccus would turn it into 1."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in tree:
            continue
        value, tp, key = tree[f.name], hints[f.name], f"{prefix}{f.name}"
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            options = [a for a in typing.get_args(tp) if a is not type(None)]
        else:
            options = [tp]
        if dataclasses.is_dataclass(options[0]) and isinstance(value, Mapping):
            _no_bools_for_numbers(options[0], value, f"{key}.")
            continue
        item = _section_values(cls, f.name)
        if item is not None and isinstance(value, Mapping):
            for k, v in value.items():
                if isinstance(v, Mapping):
                    _no_bools_for_numbers(item, v, f"{key}.{k}.")
            continue
        numeric = [a for a in options if a in (int, float)]
        if numeric and bool not in options and isinstance(value, bool):
            raise ConfigError(f"'{key}'={value!r} is invalid: a number, not true/false")
        items = [typing.get_args(a)[:1] for a in options if typing.get_origin(a) is list]
        if items and items[0] in ((int,), (float,)) and isinstance(value, list):
            if any(isinstance(v, bool) for v in value):
                raise ConfigError(f"'{key}'={value!r} is invalid: numbers, not true/false")


def _finite(value: Any, key: str) -> None:
    """Every float of a decoded config is finite (NaN passes every `<` / `>` range check)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _finite(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"'{key}'={value!r} is invalid: a finite number (not NaN or inf)")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _finite(v, f"{key}.{i}")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _finite(v, f"{key}.{k}")


def build_config(cls: type[T], tree: Mapping[str, Any] | None = None) -> T:
    """Decode a nested mapping (file contents + overrides) into `cls`, with clear errors:
    besides each section's own checks, a boolean is never a number and every float is
    finite."""
    merged = _merge(cls(), tree or {}, "")
    _no_bools_for_numbers(cls, merged, "")
    try:
        cfg = draccus.decode(cls, merged)
    except DecodingError as e:  # a value of the wrong type
        raise ConfigError(f"'{'.'.join(e.key_path)}': {_one_line(e, cls, merged)}") from e
    except DraccusException as e:  # draccus wraps what a `__post_init__` raised
        raise ConfigError(str(e.__cause__ or e)) from e
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e
    _finite(cfg, "")
    return cfg


def load_config(
    cls: type[T],
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Load `cls` from an optional YAML file and `--dotted.key value` overrides."""
    tree: Any = {}
    if path is not None:
        file = Path(path)
        if not file.exists():
            raise ConfigError(f"config file {file} does not exist")
        try:
            tree = yaml.safe_load(file.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{file} is not valid YAML: {e}") from e
        if not isinstance(tree, dict | None):
            raise ConfigError(f"{file} must hold a mapping at the top level, got {tree!r}")
        _anchor_paths(tree or {}, file.resolve().parent)
    tree = tree or {}
    for key, value in parse_overrides(overrides):
        _set_dotted(tree, key, value)
        if tuple(key.split(".")) in FILE_RELATIVE_PATHS and isinstance(value, str) and value:
            # the working directory's, made absolute: a run's config.yaml is read again by
            # other processes (servers), from other folders
            _set_dotted(tree, key, os.path.abspath(value))
    return build_config(cls, tree)


# Paths a config file may give relative to itself (a checkpoint shipped beside the config).
FILE_RELATIVE_PATHS = (
    ("agent", "weights"),
    ("agent", "hf_path"),
    ("simulator", "weights"),
    ("simulator", "hf_path"),
)


def _anchor_paths(tree: dict, folder: Path) -> None:
    """A relative model path written in a config file is relative to that file's folder
    (`configs/demo_cpu.yaml` names `pretrained/...` under `configs/`), so the config works from
    any working directory; on the command line a relative path is the working directory's.
    Both are made absolute, so a resolved config means the same from any folder."""
    for section, key in FILE_RELATIVE_PATHS:
        value = (tree.get(section) or {}).get(key) if isinstance(tree.get(section), dict) else None
        if isinstance(value, str) and value and not os.path.isabs(value):
            tree[section][key] = str(folder / value)


def dump_config(cfg: Any) -> str:
    """The resolved config as YAML (what a run directory's `config.yaml` holds)."""
    return draccus.dump(cfg, sort_keys=False)


def write_config(cfg: Any, run_dir: str | os.PathLike) -> Path:
    """Claim `run_dir` for this job (`rl.data.rundir.lock_run_dir`: RunDirInUse when another
    live job holds it), then write the resolved config into it."""
    lock_run_dir(run_dir)
    out = Path(run_dir) / CONFIG
    if is_writer():  # one process of a multi-process job writes it
        out.write_text(dump_config(cfg))
    return out
