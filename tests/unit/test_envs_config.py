"""Env configs: defaults, validation messages, YAML round trip through launch.config.loading, and no
JAX or e2b import on the config path."""

import dataclasses
import subprocess
import sys

import pytest
import yaml

from envs.config import (
    E2BConfig,
    LocalShellConfig,
    ShellConfig,
    SimulatedShellConfig,
    TerminalConfig,
    TextopsConfig,
)
from envs.e2b import E2BShell
from envs.local import LocalShell
from envs.shell import Shell
from envs.simulated import Completion, SimulatedShell
from launch.config.loading import ConfigError, build_config, dump_config

CONFIGS = [
    LocalShellConfig,
    E2BConfig,
    SimulatedShellConfig,
    ShellConfig,
    TerminalConfig,
    TextopsConfig,
]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_defaults_are_valid_frozen_and_round_trip(cls, tmp_path):
    cfg = cls()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, dataclasses.fields(cfg)[0].name, None)
    assert build_config(cls, {}) == cfg
    assert build_config(cls, yaml.safe_load(dump_config(cfg))) == cfg


def test_nested_overrides_and_errors_through_the_loader():
    cfg = build_config(
        ShellConfig,
        {"backend": "simulated", "simulated": {"max_tokens": 256}, "local": {"env": {"A": "b"}}},
    )
    assert cfg.simulated.max_tokens == 256 and cfg.local.env == {"A": "b"}
    with pytest.raises(ConfigError, match=r"LocalShellConfig.cpu_time_s=-1 is invalid"):
        build_config(ShellConfig, {"local": {"cpu_time_s": -1}})
    with pytest.raises(ConfigError, match=r"unknown key 'e2b.templat'"):
        build_config(ShellConfig, {"e2b": {"templat": "x"}})


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: LocalShellConfig(env={"A": 1}), r"LocalShellConfig.env=.*strings to strings"),
        (lambda: E2BConfig(retries=-1), r"E2BConfig.retries=-1 is invalid: an integer >= 0"),
        (lambda: E2BConfig(creation_rate_per_s=0), r"creation_rate_per_s=0 is invalid"),
        (lambda: SimulatedShellConfig(temperature=-1), r"temperature=-1 is invalid"),
        (lambda: SimulatedShellConfig(seed=-2), r"SimulatedShellConfig.seed=-2 is invalid"),
        (lambda: TerminalConfig(prompt_template="no slot"), r"containing \{instruction\}"),
        (lambda: TextopsConfig(from_file_prob=2), r"from_file_prob=2 is invalid"),
    ],
)
def test_validation_names_field_value_and_what_is_allowed(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_config_and_env_modules_import_neither_jax_nor_e2b():
    code = (
        "import sys, envs.config, envs.local, envs.e2b, envs.simulated, envs.terminal, "
        "envs.fidelity, envs.textops, envs.swe, envs.rewards; "
        "print('jax' in sys.modules, 'e2b' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_every_backend_satisfies_the_shell_protocol():
    class Client:
        async def complete(self, prompt, **kwargs):
            return Completion("")

    shells = [
        LocalShell(),
        E2BShell(run_id="r", episode_id="e"),
        SimulatedShell(Client(), task_instruction="t"),
    ]
    assert all(isinstance(s, Shell) for s in shells)
