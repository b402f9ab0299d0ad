"""Config loading and the CLI skeleton: files, dotted overrides, presets, clear errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from launch.cli import MODULES, OWN_FLAGS, SUBCOMMANDS, main
from launch.config.loading import (
    ConfigError,
    build_config,
    dump_config,
    load_config,
    parse_overrides,
)
from launch.config.schema import SimloopConfig
from rl.model.config import ModelConfig, preset, qwen3_8b, tiny

REPO = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_config_files():
    assert {p.name for p in CONFIG_FILES} >= {"demo_cpu.yaml", "v6e-8.yaml"}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_config_file_parses_and_round_trips(path, tmp_path):
    cfg = load_config(SimloopConfig, path)
    resolved = tmp_path / "config.yaml"
    resolved.write_text(dump_config(cfg))
    assert load_config(SimloopConfig, resolved) == cfg


def test_defaults_file_and_overrides_compose():
    cfg = load_config(
        SimloopConfig,
        REPO / "configs" / "demo_cpu.yaml",
        ["--agent.model.num_layers", "4", "--run.seed=7", "--sharding.rules.mlp", "[fsdp]"],
    )
    assert cfg.agent.model.num_layers == 4  # override
    assert cfg.agent.model.hidden_size == tiny().hidden_size  # preset
    assert cfg.simulator.model.num_layers == 3  # file
    assert cfg.run.seed == 7
    assert cfg.sharding.rules["mlp"] == ["fsdp"] and cfg.sharding.rules["vocab"] == ["tensor"]


def test_preset_then_field_overrides():
    cfg = build_config(SimloopConfig, {"agent": {"model": {"preset": "qwen3_8b", "num_layers": 2}}})
    assert cfg.agent.model == qwen3_8b(num_layers=2)


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"agent": {"model": {"nlayers": 3}}}, r"unknown key 'agent.model.nlayers'.*num_layers"),
        ({"trainer": {}}, r"unknown key 'trainer'.*allowed keys are \['agent'"),
        ({"agent": {"model": {"num_heads": 5}}}, r"num_kv_heads=2.*divide num_heads=5"),
        ({"agent": {"model": {"preset": "huge"}}}, r"'agent.model.preset'='huge'.*qwen3_0p6b"),
        ({"agent": {"model": {"dtype": "float8"}}}, r"dtype='float8'.*one of"),
        ({"run": {"seed": "abc"}}, r"'run.seed'.*'abc'"),
        ({"agent": {"tokenizer": {"kind": "spm"}}}, r"'agent.tokenizer.kind'.*byte, hf"),
        ({"agent": 3}, r"'agent' must be a mapping of RoleConfig fields"),
        ({"agent": {"mesh": {"fsdp": -1}}}, r"MeshConfig.fsdp=-1"),
        ({"train_sim": {"kind_weights": {"count": 0}}}, r"kind_weights.*integers >= 1"),
        ({"train_sim": {"kind_weights": {"count": 1.5}}}, r"kind_weights.*dict\[str, int\]"),
    ],
)
def test_bad_config_names_key_value_and_allowed(tree, message):
    with pytest.raises(ConfigError, match=message):
        build_config(SimloopConfig, tree)


def test_bad_files_and_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(SimloopConfig, tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(SimloopConfig, tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(SimloopConfig, tmp_path / "broken.yaml")
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--run.seed"])
    with pytest.raises(ConfigError, match="unexpected argument 'seed'"):
        parse_overrides(["seed", "3"])
    with pytest.raises(ConfigError, match="'run.seed' is a value, not a section"):
        load_config(SimloopConfig, None, ["--run.seed", "1", "--run.seed.x", "2"])


def test_overrides_are_yaml_typed_and_checked():
    cfg = load_config(
        SimloopConfig,
        None,
        ["--eval_sim.trajectories", "[runs/x, runs/y]", "--agent.hf_path=/m", "--agent.hf_path",
         "null", "--agent.model.preset", "qwen3_8b", "--agent.model.num_layers=2"],
    )  # fmt: skip
    assert cfg.eval_sim.trajectories == ["runs/x", "runs/y"]
    assert cfg.agent.hf_path is None  # the last override wins
    assert cfg.agent.model == qwen3_8b(num_layers=2)
    assert cfg.simulator.model == tiny()  # a section keeps its field's default, not the class's
    assert parse_overrides(["--run.name=", "--a.b=x=y"]) == [("run.name", ""), ("a.b", "x=y")]
    with pytest.raises(ConfigError, match=r"'run.seed': Couldn't parse 'abc' into an int"):
        load_config(SimloopConfig, None, ["--run.seed", "abc"])
    with pytest.raises(ConfigError, match=r"'eval_sim.trajectories': got 'runs/x', expected list"):
        load_config(SimloopConfig, None, ["--eval_sim.trajectories", "runs/x"])
    with pytest.raises(ConfigError, match=r"'eval_sim.max_trajectories': got 'a', expected int"):
        load_config(SimloopConfig, None, ["--eval_sim.max_trajectories", "a"])
    with pytest.raises(ConfigError, match=r"not a valid YAML value"):
        parse_overrides(["--run.seed", "[1"])


def test_dump_round_trips_a_changed_config(tmp_path):
    cfg = load_config(SimloopConfig, None, ["--agent.model.preset", "qwen3_0p6b", "--run.seed=3"])
    (tmp_path / "c.yaml").write_text(dump_config(cfg))
    assert load_config(SimloopConfig, tmp_path / "c.yaml") == cfg


def test_model_presets_have_published_sizes():
    # Parameter counts published with Qwen3 (embeddings included).
    expected = {"qwen3_0p6b": 0.6e9, "qwen3_1p7b": 1.7e9, "qwen3_4b": 4.0e9, "qwen3_8b": 8.2e9}
    for name, n in expected.items():
        assert abs(preset(name).num_params() - n) / n < 0.05, name
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("qwen9")


def test_hf_config_translation_round_trips():
    for cfg in [
        qwen3_8b(),
        tiny(),
        tiny(qk_norm=False, qkv_bias=True, architecture="Qwen2ForCausalLM"),
    ]:
        hf = cfg.to_hf()
        assert ModelConfig.from_hf(hf, param_dtype=cfg.param_dtype, dtype=cfg.dtype) == cfg
    with pytest.raises(ValueError, match="rope_type 'default'"):
        ModelConfig.from_hf({**tiny().to_hf(), "rope_scaling": {"rope_type": "yarn", "factor": 4}})


def test_cli_help_lists_every_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "launch", "--help"], capture_output=True, text=True, check=True
    ).stdout
    stable = "demo collect import train-sim eval-sim train-agent eval-agent rollout report serve"
    for name in stable.split() + ["plan-chips", "gke", "tpu-vm"]:
        assert name in SUBCOMMANDS and f"    {name}" in out


def test_every_subcommand_has_a_module_with_run():
    import importlib

    assert set(MODULES) | {"config"} == set(SUBCOMMANDS)
    for name, module in MODULES.items():
        mod = importlib.import_module(module)
        assert callable(mod.run), name
        if name in OWN_FLAGS:
            assert callable(mod.add_arguments), name


EXPLORE = ["--collect.style", "explore"]


def test_user_mistakes_end_in_one_line_not_a_traceback(tmp_path):
    """A missing file, a bad value, a missing flag: one line `simloop CMD: ...`, exit 2."""
    cases = [
        ["train-sim", "--out", str(tmp_path / "a")],  # no trajectories configured
        [
            "train-sim",
            "--out",
            str(tmp_path / "b"),
            "--train_sim.trajectories",
            f"[{tmp_path / 'missing'}]",
        ],
        ["report", str(tmp_path / "nowhere")],
        ["eval-agent", "--out", str(tmp_path / "c")],  # no agent weights
        ["collect"],  # no --out
        # more commands than max_turns allows, and no command at all
        ["collect", "--out", str(tmp_path / "d"), *EXPLORE, "--collect.commands", "500"],
        ["collect", "--out", str(tmp_path / "e"), "--collect.commands", "0"],
        ["plan-chips", "--accelerator", "v6e-8", "--roles", "policy_train=3"],
    ]
    for argv in cases:
        r = subprocess.run(
            [sys.executable, "-m", "launch", *argv],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert r.returncode == 2, (argv, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr, (argv, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert lines and lines[-1].startswith(f"simloop {argv[0]}"), (argv, r.stderr)


def test_config_error_exits_2_with_message(capsys):
    assert main(["config", "--agent.model.nlayers", "3"]) == 2
    assert "unknown key 'agent.model.nlayers'" in capsys.readouterr().err


def test_config_validation_never_imports_jax():
    code = (
        "import sys; from launch.cli import main; "
        f"rc = main(['config', '--config', {str(REPO / 'configs/v6e-8.yaml')!r}]); "
        "assert rc == 0, rc; "
        "bad = [m for m in ('jax', 'flax', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_model_paths_in_a_config_file_are_relative_to_the_file(tmp_path, monkeypatch):
    folder = tmp_path / "cfgs"
    folder.mkdir()
    path = folder / "c.yaml"
    path.write_text("simulator:\n  weights: pretrained/sim\nagent:\n  hf_path: /abs/model\n")
    monkeypatch.chdir(tmp_path)  # not the file's folder
    cfg = load_config(SimloopConfig, path)
    assert cfg.simulator.weights == str(folder / "pretrained" / "sim")
    assert cfg.agent.hf_path == "/abs/model"
    # On the command line a relative path is the working directory's, as a shell user expects.
    cfg = load_config(SimloopConfig, path, ["--simulator.weights", "runs/sim/weights/final"])
    assert cfg.simulator.weights == str(tmp_path / "runs" / "sim" / "weights" / "final")
    # ... and stays that path when a run's resolved config.yaml is read from another folder
    # (a server started by the job reads it from the run directory).
    (tmp_path / "run").mkdir()
    written = tmp_path / "run" / "config.yaml"
    written.write_text(dump_config(cfg))
    monkeypatch.chdir(folder)
    assert load_config(SimloopConfig, written).simulator.weights == cfg.simulator.weights
    # The demo's shipped simulator is found from any working directory.
    demo = load_config(SimloopConfig, REPO / "configs" / "demo_cpu.yaml")
    assert Path(demo.simulator.weights).is_dir()
    assert demo.simulator.weights == str(REPO / "configs" / "pretrained" / "sim-textops")


def test_train_sim_kind_weights_repeat_a_kinds_trajectories_in_place():
    from launch.jobs.train_sim import weighted_by_kind
    from rl.data.trajectory import Trajectory

    def traj(i, kind):
        return Trajectory(
            task_id=f"t{i}",
            arm="real",
            env_backend="local",
            status="ok",
            reward=0.0,
            task_kind=kind,
        )

    trajs = [traj(0, "count"), traj(1, "sort"), traj(2, None), traj(3, "count")]
    assert weighted_by_kind(trajs, None) is trajs
    out = weighted_by_kind(trajs, {"count": 3, "upper": 2})
    assert [t.task_id for t in out] == ["t0"] * 3 + ["t1", "t2"] + ["t3"] * 3
