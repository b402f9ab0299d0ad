"""Config loading: a YAML file plus dotted command-line overrides into frozen dataclasses.

    cfg = load_config(SimloopConfig, "configs/demo_cpu.yaml", ["--agent.model.num_layers", "4"])

Order of precedence: the dataclass defaults, then the file, then the overrides. A section typed
`ModelConfig` also accepts `preset: NAME` (tiny, qwen3_0p6b, ...), whose fields sit between the
defaults and the file's other keys. Keys are checked against the dataclass fields first (so an
unknown key names the keys that are allowed); draccus then converts and type-checks the values,
and each dataclass's `__post_init__` validates them. Imports no JAX.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import draccus
import yaml
from draccus.utils import DecodingError, DraccusException

from rl.model.config import PRESETS, ModelConfig, preset

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key, value and what is
    allowed."""


def parse_overrides(args: Sequence[str]) -> list[tuple[str, Any]]:
    """`["--a.b", "1", "--c=x"]` -> `[("a.b", 1), ("c", "x")]`; values are parsed as YAML."""
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides look like --section.key VALUE"
            )
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value")
            i += 1
            value = args[i]
        out.append((key, _parse_value(key, value)))
        i += 1
    return out


def _parse_value(key: str, text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override --{key}={text!r} is not a valid YAML value: {e}") from e


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"override --{key}: '{where}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _dataclass_type(tp: Any) -> type | None:
    """The dataclass inside `tp` (also through `X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def _resolve(cls: type, default: Any, user: Any, path: str) -> dict[str, Any]:
    """Merge `user` over `default` (an instance of `cls`), checking keys and expanding
    presets; returns a plain dict for draccus to decode."""
    where = path or "the config"
    if not isinstance(user, Mapping):
        raise ConfigError(f"'{where}' must be a mapping of {cls.__name__} fields, got {user!r}")
    user = dict(user)
    if cls is ModelConfig and "preset" in user:
        name = user.pop("preset")
        if name not in PRESETS:
            raise ConfigError(
                f"'{_join(path, 'preset')}'={name!r} is invalid: one of {sorted(PRESETS)}"
            )
        default = preset(name)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in user if k not in fields]
    if unknown:
        allowed = sorted(fields) + (["preset"] if cls is ModelConfig else [])
        raise ConfigError(
            f"unknown key '{_join(path, str(unknown[0]))}' in {cls.__name__}: "
            f"allowed keys are {allowed}"
        )
    merged = draccus.encode(default) if default is not None else {}
    for key, value in user.items():
        sub = _dataclass_type(hints[key])
        if sub is not None and value is not None:
            sub_default = getattr(default, key, None) if default is not None else None
            if sub_default is None:
                sub_default = _default_instance(sub)
            merged[key] = _resolve(sub, sub_default, value, _join(path, key))
        else:
            merged[key] = value
    return merged


def _default_instance(cls: type) -> Any:
    try:
        return cls()
    except TypeError:  # required fields: start from nothing
        return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def build_config(cls: type[T], tree: Mapping[str, Any] | None = None) -> T:
    """Decode a nested mapping (file contents + overrides) into `cls`, with clear errors."""
    merged = _resolve(cls, _default_instance(cls), tree or {}, "")
    try:
        return draccus.decode(cls, merged)
    except DecodingError as e:
        key = ".".join(e.key_path) if getattr(e, "key_path", None) else "?"
        raise ConfigError(f"'{key}': {getattr(e, 'message', e)}") from e
    except DraccusException as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ValueError | TypeError):
            raise ConfigError(str(cause)) from e
        raise ConfigError(str(e)) from e
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e


def load_config(
    cls: type[T],
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Load `cls` from an optional YAML file and `--dotted.key value` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.exists():
            raise ConfigError(f"config file {file} does not exist")
        try:
            loaded = yaml.safe_load(file.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{file} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{file} must hold a mapping at the top level, got {loaded!r}")
        tree = loaded or {}
    for key, value in parse_overrides(overrides):
        _set_dotted(tree, key, value)
    return build_config(cls, tree)


def dump_config(cfg: Any) -> str:
    """The resolved config as YAML (what a run directory's `config.yaml` holds)."""
    return yaml.safe_dump(draccus.encode(cfg), sort_keys=False)


def write_config(cfg: Any, run_dir: str | os.PathLike) -> Path:
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_config(cfg))
    return out
