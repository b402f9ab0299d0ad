"""`simloop tpu-vm`: the exact gcloud commands (golden files), quoting, and clear errors.

The golden files in tests/golden/tpu_vm/ hold the `--dry-run` output of each scenario. After an
intended change, rewrite them and read the diff before committing:

    SIMLOOP_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/unit/test_tpu_vm.py -k golden

No test here runs the real gcloud: runs without --dry-run put a fake one first on PATH.
"""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from launch.cli import main
from launch.config.loading import load_config
from launch.config.schema import SimloopConfig
from launch.deploy.tpu_vm import (
    TpuVmError,
    TpuVmOptions,
    build_commands,
    remote_command,
    remote_dir,
)

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "tpu_vm"
BASE = ["--chips.accelerator", "v6e-8", "--tpu_vm.project", "my-proj"]
# Executed by a real sh in some tests, so their payloads only create marker files.
HOSTILE = [
    "; touch pwned0",
    "$(touch pwned1)",
    "`touch pwned2`",
    'it\'s "quoted"',
    "a && touch pwned3 || true",
    "${HOME}/*",
]
# Only ever printed or passed as argv, never handed to a shell here.
DESTRUCTIVE = ["; rm -rf /", "$(rm -rf ~)"]

SCENARIOS = {
    "create": ["create"],
    "create_queued_spot": [
        "create",
        *["--tpu_vm.queued", "true", "--tpu_vm.spot", "true"],
        *["--tpu_vm.network", "my-net", "--tpu_vm.subnetwork", "my-subnet"],
        *["--tpu_vm.service_account", "simloop@my-proj.iam.gserviceaccount.com"],
    ],
    "ssh": ["ssh"],
    "run": ["run", "--", "python", "-m", "launch", "demo", "--config", "c.yaml", "--out", "r"],
    "copy": ["copy", "--remote", "runs/demo", "--local", "runs/demo"],
    "delete": ["delete"],
    "delete_queued": ["delete", "--tpu_vm.queued", "true"],
    "run_planned": ["run", "--planned", "--config", "configs/v6e-8.yaml", "--", "simloop",
                    "train-agent", "--config", "configs/v6e-8.yaml", "--out", "runs/v6e-8"],
}  # fmt: skip


def _cfg(*overrides: str) -> SimloopConfig:
    return load_config(SimloopConfig, None, [*BASE, *overrides])


def _cli(capsys, action: str, *rest: str) -> tuple[int, str, str]:
    """`simloop tpu-vm ACTION --dry-run` with the base config, then `rest` (`--` goes last)."""
    rc = main(["tpu-vm", action, "--dry-run", *BASE, *rest])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_dry_run_matches_golden(name, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # `--config configs/...` as the workers read it, from the checkout
    rc, out, err = _cli(capsys, *SCENARIOS[name])
    assert rc == 0, err
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("SIMLOOP_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out)
    assert out == path.read_text()


def test_dry_run_lines_parse_back_to_the_argv_lists(capsys):
    """What --dry-run prints, pasted into a shell, is exactly what would run."""
    overrides = ["--tpu_vm.network", DESTRUCTIVE[0], "--tpu_vm.service_account", DESTRUCTIVE[1]]
    cfg = _cfg(*overrides)
    words = ["python", "-m", "launch", "demo", *DESTRUCTIVE, *HOSTILE]
    expected = build_commands("run", cfg, TpuVmOptions(command=tuple(words)))
    expected += build_commands("create", cfg, TpuVmOptions())
    _, run_out, _ = _cli(capsys, "run", *overrides, "--", *words)
    _, create_out, _ = _cli(capsys, "create", *overrides)
    lines = (run_out + create_out).splitlines()
    assert [shlex.split(line) for line in lines] == expected
    create = expected[1]
    # Config values stay single argv elements after their flag, never split or interpreted.
    assert create[create.index("--network") + 1] == DESTRUCTIVE[0]
    assert create[create.index("--service-account") + 1] == DESTRUCTIVE[1]
    # Each word is one shell word of the remote command, after `cd REPO_DIR &&`.
    remote = expected[0][expected[0].index("--command") + 1]
    assert shlex.split(remote) == ["cd", "~/simloop", "&&", *words]


def test_planned_run_starts_the_worker_entry_with_the_config_as_given_here(capsys, monkeypatch):
    """Every worker runs `launch.deploy.tpu_worker` with the same config path and overrides
    around the trainers' command: the one after `--`, else `tpu_vm.command`."""
    monkeypatch.chdir(REPO)
    config = "configs/v6e-32.yaml"
    words = ["simloop", "train-sim", "--config", "$SIMLOOP_CONFIG", *HOSTILE]
    rc, out, err = _cli(capsys, "run", "--planned", "--config", config, "--", *words)
    assert rc == 0, err
    (argv,) = [shlex.split(line) for line in out.splitlines()]
    assert "--worker=all" in argv
    remote = shlex.split(argv[argv.index("--command") + 1])
    assert remote == ["cd", "~/simloop", "&&", "python", "-m", "launch.deploy.tpu_worker",
                      "--config", config, *BASE, "--", *words]  # fmt: skip
    own = ["--tpu_vm.command", "[bash, -c, 'exec simloop train-agent']"]
    rc, out, err = _cli(capsys, "run", "--planned", "--config", config, *own)
    assert rc == 0, err
    (argv,) = [shlex.split(line) for line in out.splitlines()]
    remote = shlex.split(argv[argv.index("--command") + 1])
    assert remote[remote.index("--") :] == ["--", "bash", "-c", "exec simloop train-agent"]
    assert remote[remote.index("--config") : remote.index("--")] == [
        "--config",
        config,
        *BASE,
        *own,
    ]


def test_words_after_double_dash_are_the_command_not_config_overrides(capsys):
    rc, out, err = _cli(capsys, "run", "--", "simloop", "config", "--run.seed", "7")
    assert rc == 0, err
    (argv,) = [shlex.split(line) for line in out.splitlines()]
    assert argv[argv.index("--command") + 1] == "cd ~/simloop && simloop config --run.seed 7"


def test_remote_command_is_inert_in_a_real_shell(tmp_path):
    """The `--command` text, run by sh as the worker's shell would: nothing but the words."""
    odd = "odd dir; touch pwned4 $(touch pwned5) 'q\""
    (tmp_path / odd).mkdir()
    env = {"HOME": str(tmp_path), "PATH": os.environ["PATH"]}

    def sh(text: str) -> str:
        done = subprocess.run(
            ["sh", "-c", text], env=env, cwd=tmp_path, capture_output=True, text=True, check=True
        )
        return done.stdout

    words = ["printf", "%s\\n", *HOSTILE]
    assert sh(remote_command(f"~/{odd}", words)).splitlines() == HOSTILE
    assert sh(remote_command(f"~/{odd}", ["pwd"])).strip() == str(tmp_path / odd)
    assert sh(remote_command(str(tmp_path / odd), ["pwd"])).strip() == str(tmp_path / odd)
    assert not list(tmp_path.rglob("pwned*"))


@pytest.mark.parametrize(
    "repo_dir, quoted",
    [
        ("~", "~"),
        ("~/", "~"),
        ("~/simloop", "~/simloop"),
        ("~/my repo", "~/'my repo'"),
        ("/opt/simloop", "/opt/simloop"),
        ("/opt/a;b", "'/opt/a;b'"),
        ("~user/x", "'~user/x'"),
    ],
)
def test_repo_dir_keeps_home_expandable_and_quotes_the_rest(repo_dir, quoted):
    assert remote_dir(repo_dir) == quoted


def test_worker_bounds_follow_the_slice():
    cfg = _cfg("--chips.accelerator", "v6e-32")  # 8 hosts of 4 chips
    (argv,) = build_commands("ssh", cfg, TpuVmOptions(worker="7"))
    assert argv[-1] == "--worker=7"
    with pytest.raises(TpuVmError, match=r"--worker 8 is not a worker of v6e-32.*0\.\.7 or all"):
        build_commands("ssh", cfg, TpuVmOptions(worker="8"))
    (argv,) = build_commands("run", cfg, TpuVmOptions(worker="3", command=("ls",)))
    assert "--worker=3" in argv


@pytest.mark.parametrize(
    "action, rest, message",
    [
        ("copy", ["--local", "runs/x"], r"copy needs --remote: --remote DIR"),
        ("copy", [], r"copy needs --remote and --local"),
        ("copy", ["--remote", "runs/$(id)", "--local", "x"], r"'~/simloop/runs/\$\(id\)'.*plain"),
        ("copy", ["--remote", "r", "--local=-x"], r"--local '-x' is invalid"),
        ("copy", ["--remote", "r", "--local", "x", "--worker", "all"], r"'all' is invalid: 0, 1"),
        ("ssh", ["--worker", "foo"], r"--worker 'foo' is invalid: 0, 1, \.\.\. .* or all"),
        ("ssh", ["--worker", "-1"], r"--worker '-1' is invalid"),
        ("ssh", ["--worker", "2"], r"--worker 2 is not a worker of v6e-8.*1 host.*one of 0 or all"),
        ("create", ["--chips.accelerator", "cpu-8"], r"'cpu-8' is not a TPU.*such as v6e-8"),
        ("create", ["--chips.accelerator", "v9x-8"], r"chips.accelerator: .*'v9x-8'.*v6e-"),
        ("create", ["--worker", "1"], r"--worker applies to ssh, run, copy only, not to create"),
        ("delete", ["--remote", "x"], r"--remote applies to copy only"),
        ("run", [], r"run needs the command after '--'"),
        ("run", ["--"], r"run needs the command after '--'"),
        ("ssh", ["--", "ls"], r"only run takes a command after '--'"),
        ("create", ["--tpu_vm.project", "-oProxyCommand=x"], r"tpu_vm.project='-oProxy.*'-'"),
        ("run", ["--tpu_vm.repo_dir", "''", "--", "ls"], r"tpu_vm.repo_dir='' is invalid"),
        ("run", ["--planned"], r"run --planned needs the trainers' command: after '--'.*tpu_vm"),
        ("run", ["--planned", "--", "ls"], r"run --planned needs --config: every worker"),
        ("ssh", ["--planned"], r"--planned applies to run only, not to ssh"),
    ],
)
def test_errors_name_what_is_wrong_and_exit_2(capsys, action, rest, message):
    rc, out, err = _cli(capsys, action, *rest)
    assert rc == 2 and out == ""
    assert err.startswith(f"simloop tpu-vm {action}: ")
    assert re.search(message, err), err


def test_no_action_says_which_exist(capsys):
    assert main(["tpu-vm", "--dry-run"]) == 2
    assert "say which action: create, ssh, run, copy, delete" in capsys.readouterr().err


def _fake_gcloud(tmp_path: Path, monkeypatch, rc: int) -> Path:
    """A `gcloud` first on PATH that records its argv (NUL-separated) and exits with rc."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "argv.bin"
    script = bin_dir / "gcloud"
    script.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {shlex.quote(str(log))}\nexit {rc}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_runs_gcloud_with_argv_elements_and_returns_its_exit_code(tmp_path, monkeypatch, capsys):
    log = _fake_gcloud(tmp_path, monkeypatch, rc=7)
    words = ["echo", *HOSTILE]
    assert main(["tpu-vm", "run", *BASE, "--", *words]) == 7
    (expected,) = build_commands("run", _cfg(), TpuVmOptions(command=tuple(words)))
    assert log.read_bytes().split(b"\0")[:-1] == [a.encode() for a in expected[1:]]
    assert not list(tmp_path.rglob("pwned*"))
    assert capsys.readouterr().out == ""


def test_create_prints_next_steps_after_success(tmp_path, monkeypatch, capsys):
    _fake_gcloud(tmp_path, monkeypatch, rc=0)
    assert main(["tpu-vm", "create", *BASE, "--tpu_vm.queued", "true"]) == 0
    out = capsys.readouterr().out
    assert "gcloud compute tpus queued-resources describe simloop --zone us-east5-b" in out
    assert "simloop tpu-vm delete" in out and "--command 'git clone REPO_URL ~/simloop'" in out


def test_missing_gcloud_says_to_install_the_sdk(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["tpu-vm", "ssh", *BASE]) == 2
    err = capsys.readouterr().err
    assert "`gcloud` is not on PATH" in err and "Google Cloud SDK" in err
