"""`MetricsLog` mirrors `metrics.jsonl` to TensorBoard event files and (when turned on) W&B:
tags, steps, one event file per run directory, flushed per write, W&B optional and offline."""

import argparse
import json
import logging
import math
import struct
import subprocess
import sys
import time
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c

from rl.data import metrics_sinks, rundir
from rl.data.metrics_sinks import EventFile, flatten
from rl.data.rundir import MetricsLog

SFT = [{"stage": "sim_sft", "step": 10 * i, "loss": 1 / i, "lr": 0.25} for i in (1, 2, 4)]
EVAL = {
    "stage": "eval",
    "label": "before",
    "arm": "real",
    "version": 3,
    "success_rate": 0.5,
    "by_kind": {"sort": {"episodes": 4, "success": 0.75}},
    "statuses": {"ok": 3, "error": 1},
}
ROLLOUT = {
    "stage": "rl_rollout",
    "arm": "closed_loop",
    "time": 1.5e9,
    "episodes": 12,
    "status": {"ok": 11, "timeout": 1},
    "active_per_turn": [12, 9, 4],
    "pathologies": {},
    "note": "text",
    "kl": float("nan"),
    "slow": float("inf"),
    "resumed": True,
}


def read_events(logdir) -> list[Event]:
    """Every `Event` in the directory's event files, checking the TFRecord framing."""
    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            header = data[i : i + 8]
            (n,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[i + 8 : i + 12])[0] == masked_crc32c(header)
            body = data[i + 12 : i + 12 + n]
            assert struct.unpack("<I", data[i + 12 + n : i + 16 + n])[0] == masked_crc32c(body)
            events.append(Event.FromString(body))
            i += 16 + n
    return events


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] in file order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for e in read_events(logdir):
        for v in e.summary.value:
            out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


@pytest.fixture
def no_wandb(monkeypatch):
    """W&B off and `import wandb` failing, whatever is installed; state restored after."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr(metrics_sinks, "_wandb", None)
    monkeypatch.setattr(metrics_sinks, "_wandb_warned", False)


def test_flatten_tags_nesting_and_skips():
    stage, step, scalars = flatten(EVAL)
    assert (stage, step) == ("eval", None)
    assert scalars == {
        "eval/before/real/version": 3.0,
        "eval/before/real/success_rate": 0.5,
        "eval/before/real/by_kind/sort/episodes": 4.0,
        "eval/before/real/by_kind/sort/success": 0.75,
        "eval/before/real/statuses/ok": 3.0,
        "eval/before/real/statuses/error": 1.0,
    }
    # strings, lists, empty dicts, None, NaN, inf and the wall clock are not scalars;
    # bools are 0/1
    assert flatten(ROLLOUT)[2] == {
        "rl_rollout/closed_loop/episodes": 12.0,
        "rl_rollout/closed_loop/status/ok": 11.0,
        "rl_rollout/closed_loop/status/timeout": 1.0,
        "rl_rollout/closed_loop/resumed": 1.0,
    }
    deep = {"stage": "x", "event": "summary", "step": np.int64(7), "a": {"b": {"c": {"d": 1}}}}
    assert flatten(deep) == ("x", 7, {})  # two levels of nesting, no more
    assert flatten({"step": 1, "loss": np.float32(0.5)}) == ("metrics", 1, {"metrics/loss": 0.5})


def test_scalars_reach_tensorboard_with_steps(tmp_path, no_wandb):
    run = tmp_path / "run"
    for r in SFT:  # jobs open a log per write; they must share one event file
        MetricsLog(run).write(r)
    with MetricsLog(run) as log:
        log.write(EVAL)
        log.write({**EVAL, "label": "after", "success_rate": 0.75})
        log.write(ROLLOUT)
        log.write({"stage": "sim_sft", "event": "summary", "wall_s": 31.0})
    logdir = run / rundir.TENSORBOARD
    assert len(list(logdir.iterdir())) == 1
    scalars = read_scalars(logdir)
    assert scalars["sim_sft/loss"] == [(10, 1.0), (20, 0.5), (40, 0.25)]
    assert scalars["sim_sft/lr"] == [(10, 0.25), (20, 0.25), (40, 0.25)]
    # step-less records count per stage: eval before 0, after 1; the summary is sim_sft's 0th
    assert scalars["eval/before/real/success_rate"] == [(0, 0.5)]
    assert scalars["eval/after/real/success_rate"] == [(1, 0.75)]
    assert scalars["eval/before/real/by_kind/sort/success"] == [(0, 0.75)]
    assert scalars["rl_rollout/closed_loop/status/ok"] == [(0, 11.0)]
    assert scalars["sim_sft/summary/wall_s"] == [(0, 31.0)]
    assert not any("note" in t or "kl" in t or "active_per_turn" in t for t in scalars)
    rollout_event = next(
        e
        for e in read_events(logdir)
        if e.step == 0 and e.summary.value and e.summary.value[0].tag.startswith("rl_rollout")
    )
    assert rollout_event.wall_time == 1.5e9  # the record's own time
    # metrics.jsonl is exactly what it was: every key, NaN/inf as null
    lines = (run / rundir.METRICS).read_text().splitlines()
    assert [json.loads(x) for x in lines[:3]] == SFT
    assert json.loads(lines[5]) == {
        **ROLLOUT,
        "kl": None,
        "slow": None,
    }
    assert len(lines) == 7


def test_events_are_on_disk_before_close(tmp_path, no_wandb):
    """A killed run keeps its events: each write is flushed."""
    run = tmp_path / "run"
    log = MetricsLog(run)
    try:
        log.write(SFT[0])
        assert read_scalars(run / rundir.TENSORBOARD)["sim_sft/loss"] == [(10, 1.0)]
        log.write(SFT[1])
        assert read_scalars(run / rundir.TENSORBOARD)["sim_sft/loss"] == [(10, 1.0), (20, 0.5)]
    finally:
        log.close()


def test_reopening_after_close_adds_one_file(tmp_path, no_wandb):
    run = tmp_path / "run"
    MetricsLog(run).write({"stage": "s", "note": "no numbers"})
    assert not (run / rundir.TENSORBOARD).exists()  # nothing to plot, no file
    with MetricsLog(run) as log:
        log.write(SFT[0])
    with MetricsLog(run) as log:
        log.write(SFT[1])
        log.write(SFT[2])
    assert len(list((run / rundir.TENSORBOARD).iterdir())) == 2
    assert read_scalars(run / rundir.TENSORBOARD)["sim_sft/loss"] == [
        (10, 1.0),
        (20, 0.5),
        (40, 0.25),
    ]


def test_files_opened_within_a_second_sort_in_the_order_they_were_opened(tmp_path, monkeypatch):
    # The process's 9th and 10th event files, in one second: readers take them by name.
    monkeypatch.setattr(EventFile, "_opened", 8)
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    first, second = EventFile(tmp_path), EventFile(tmp_path)
    first.close()
    second.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.path.name, second.path.name]


@settings(max_examples=200, deadline=None)
@given(
    wall_time=st.floats(allow_nan=False),
    step=st.integers(-(2**63), 2**63 - 1),
    scalars=st.one_of(
        st.none(), st.dictionaries(st.text(max_size=40), st.floats(width=32), max_size=4)
    ),
    version=st.one_of(st.none(), st.text(max_size=20)),
)
def test_event_bytes_are_what_protobuf_serializes(wall_time, step, scalars, version):
    """simloop encodes its events itself; protobuf (tensorboardX's generated classes) must
    produce the same bytes, and TFRecord's checksum must agree with tensorboardX's."""
    if version is not None:
        scalars = None  # one of the two: they share the Event's oneof
    kw = {} if version is None else {"file_version": version}
    expected = Event(wall_time=wall_time, step=step, **kw)
    if scalars is not None:
        expected.summary.SetInParent()
        expected.summary.value.extend(
            Summary.Value(tag=t, simple_value=v) for t, v in scalars.items()
        )
    got = metrics_sinks.event_bytes(wall_time, step=step, file_version=version, scalars=scalars)
    assert got == expected.SerializeToString()
    assert metrics_sinks.masked_crc32c(got) == masked_crc32c(got)


def test_logging_imports_neither_tensorboardx_nor_torch(tmp_path):
    """tensorboardX's package imports PyTorch when it is installed (1.4 s of CPU in each
    process that logs); a job's metrics log needs neither."""
    code = (
        "import sys; from rl.data.rundir import MetricsLog\n"
        f"MetricsLog({str(tmp_path / 'run')!r}).write({{'stage': 's', 'step': 1, 'loss': 0.5}})\n"
        "print(sorted(m for m in ('torch', 'tensorboardX') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert read_scalars(tmp_path / "run" / rundir.TENSORBOARD) == {"s/loss": [(1, 0.5)]}


def test_tensorboard_reads_the_event_files(tmp_path, no_wandb):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run = tmp_path / "run"
    with MetricsLog(run) as log:
        for r in [*SFT, EVAL]:
            log.write(r)
    acc = accumulator.EventAccumulator(str(run / rundir.TENSORBOARD))
    acc.Reload()
    assert "sim_sft/loss" in acc.Tags()["scalars"]
    assert [(s.step, s.value) for s in acc.Scalars("sim_sft/loss")] == [
        (10, 1.0),
        (20, 0.5),
        (40, 0.25),
    ]
    assert [s.value for s in acc.Scalars("eval/before/real/by_kind/sort/success")] == [0.75]


def test_wandb_missing_warns_once_and_logs_locally(tmp_path, no_wandb, caplog):
    with caplog.at_level(logging.WARNING, logger=metrics_sinks.__name__):
        assert metrics_sinks.configure_wandb(True, mode="offline") is None
        assert metrics_sinks.configure_wandb(True, mode="offline") is None
    warnings = [r for r in caplog.records if "wandb is not installed" in r.getMessage()]
    assert len(warnings) == 1
    run = tmp_path / "run"
    with MetricsLog(run) as log:
        log.write(SFT[0])
    assert json.loads((run / rundir.METRICS).read_text()) == SFT[0]
    assert read_scalars(run / rundir.TENSORBOARD)["sim_sft/loss"] == [(10, 1.0)]
    assert not (run / "wandb").exists()


def test_wandb_failing_to_start_costs_only_wandb(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    monkeypatch.setattr(metrics_sinks, "_wandb", None)
    assert metrics_sinks.configure_wandb(True, mode="online").mode == "online"

    def unreachable(*args, **kwargs):
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setattr(metrics_sinks, "WandbRun", unreachable)
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger=metrics_sinks.__name__):
        with MetricsLog(run) as log:
            log.write(SFT[0])
            log.write(SFT[1])
    assert sum("W&B logging is off" in r.getMessage() for r in caplog.records) == 1
    assert read_scalars(run / rundir.TENSORBOARD)["sim_sft/loss"] == [(10, 1.0), (20, 0.5)]


def test_cli_turns_wandb_on_from_the_run_config(monkeypatch):
    from launch import cli
    from launch.config.schema import RunConfig, SimloopConfig

    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    monkeypatch.setattr(metrics_sinks, "_wandb", None)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    seen = []
    job = types.ModuleType("fake_job")
    job.run = lambda args, cfg: seen.append(metrics_sinks.wandb_options())
    monkeypatch.setitem(sys.modules, "fake_job", job)
    monkeypatch.setitem(cli.MODULES, "collect", "fake_job")
    run = RunConfig(name="exp1", wandb=True, wandb_project="proj")
    assert cli._dispatch(argparse.Namespace(command="collect"), SimloopConfig(run=run)) is None
    assert cli._dispatch(argparse.Namespace(command="collect"), SimloopConfig()) is None
    assert seen == [
        metrics_sinks.WandbOptions(project="proj", group="exp1", mode="offline"),
        None,
    ]


def test_run_config_wandb_fields():
    from launch.config.schema import RunConfig

    assert (RunConfig().wandb, RunConfig().wandb_mode) == (False, "auto")
    with pytest.raises(ValueError, match="wandb_mode"):
        RunConfig(wandb_mode="cloud")
    with pytest.raises(ValueError, match="wandb_project"):
        RunConfig(wandb_project="")
    with pytest.raises(ValueError, match="invalid"):
        metrics_sinks.configure_wandb(True, mode="cloud")


def read_wandb_records(path) -> list:
    """The `Record` protos of an offline run's `.wandb` file (LevelDB log framing: a 7-byte
    file header, 32 KiB blocks of [crc 4, length 2, type 1] chunks; 1 full, 2-4 split)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, i, buf = [], 7, b""
    while i + 7 <= len(data):
        if block - i % block < 7:  # a block's tail too short for a header is padding
            i += block - i % block
            continue
        _, n, kind = struct.unpack("<IHB", data[i : i + 7])
        buf += data[i + 7 : i + 7 + n]
        i += 7 + n
        if kind in (1, 4):
            records.append(Record.FromString(buf))
            buf = b""
    return records


def test_wandb_offline_run_under_the_run_dir(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(metrics_sinks, "_wandb", None)
    options = metrics_sinks.configure_wandb(True, project="simloop-test", group="g", mode="auto")
    assert options is not None and options.mode == "offline"  # no API key: never the network
    run = tmp_path / "sim"
    run.mkdir()
    (run / rundir.CONFIG).write_text("run:\n  name: g\n  seed: 3\n")
    with MetricsLog(run) as log:
        for r in SFT:
            log.write(r)
        log.write(EVAL)
    # `finish()` hands the run to W&B's service process, which writes the file on its own time;
    # stopping the service waits for it.
    wandb.teardown()
    (wandb_file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    records = read_wandb_records(wandb_file)
    (meta,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (meta.project, meta.run_group, meta.display_name) == ("simloop-test", "g", "sim")
    config = {u.key: json.loads(u.value_json) for u in meta.config.update}
    assert config["run"] == {"name": "g", "seed": 3}
    history = [
        {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["sim_sft/step"], h["sim_sft/loss"]) for h in history[:3]] == [
        (10, 1.0),
        (20, 0.5),
        (40, 0.25),
    ]
    assert history[3]["eval/step"] == 0
    assert math.isclose(history[3]["eval/before/real/by_kind/sort/success"], 0.75)
    metrics = {r.metric.glob_name: r.metric.step_metric for r in records if r.metric.glob_name}
    assert metrics == {"sim_sft/*": "sim_sft/step", "eval/*": "eval/step"}
