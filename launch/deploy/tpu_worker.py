"""The TPU VM worker entry: start this worker's share of the chip plan. `simloop tpu-vm run
--planned` runs it on every worker of the slice; it is the TPU VM counterpart of the GKE pod
entry (`launch/deploy/gke_pod.py`), and starts its processes the same way (`gke_pod.launch`).

    # what `simloop tpu-vm run --config configs/v6e-32.yaml --planned` runs on every worker:
    cd ~/simloop && python -m launch.deploy.tpu_worker --config configs/v6e-32.yaml -- \
        bash -c 'case "$SIMLOOP_ROLE" in ... esac'
    # on any machine, what worker 4 of a v6e-32 would start (prints it, starts nothing):
    python -m launch.deploy.tpu_worker --config configs/v6e-32.yaml --worker-index 4 \
        --worker-addresses 10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5,10.0.0.6,10.0.0.7,10.0.0.8,10.0.0.9 \
        --dry-run -- true

Which worker this is, and every worker's address: the TPU VM metadata server's
`agent-worker-number` and `worker-network-endpoints` (what JAX itself reads on a TPU VM), or
--worker-index and --worker-addresses. It plans the config's `chips:` with the workers'
internal addresses as host names (a one-host slice: localhost), then starts the processes the
plan puts on its host: each server with its own command (`vllm serve ...`), then each trainer
with COMMAND, its role in SIMLOOP_ROLE, the config as resolved here (overrides applied) in
SIMLOOP_CONFIG, the servers' URLs in SIMLOOP_SERVER_URLS and, in a group of several hosts,
the multi-process contract (`launch/deploy/tpu_vm.py` says which values). It exits 0 when its
trainers have (its servers are then stopped), with the first failure's status, or after
stopping them all on SIGTERM, SIGINT or SIGHUP.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from launch.deploy.gke import LIBTPU_LOCKFILE

EXIT_USAGE = 2
METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
METADATA_TIMEOUT_S = 10.0


def metadata(key: str, *, base: str = METADATA_URL, timeout_s: float = METADATA_TIMEOUT_S) -> str:
    """One attribute of this TPU VM from the metadata server (never through a proxy)."""
    request = urllib.request.Request(base + key, headers={"Metadata-Flavor": "Google"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout_s) as r:
        return r.read().decode().strip()


def parse_endpoints(text: str) -> list[str]:
    """`worker-network-endpoints` -> the workers' addresses, worker 0 first. Entries are plain
    addresses or `name:id:address` triples (the two forms JAX accepts)."""
    out = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        parts = entry.split(":")
        if len(parts) not in (1, 3) or not parts[-1]:
            raise ValueError(
                f"worker-network-endpoints entry {entry!r}: want ADDRESS or NAME:ID:ADDRESS"
            )
        out.append(parts[-1])
    return out


def _identity(args: argparse.Namespace, hosts: int, base: str) -> tuple[int, list[str]]:
    """(this worker's index, every worker's address): from the flags, else the metadata
    server; a one-host slice is worker 0 on localhost."""
    if hosts == 1:
        return (args.worker_index or 0), ["localhost"]
    index = args.worker_index
    if index is None:
        index = int(metadata("agent-worker-number", base=base))
    if args.worker_addresses:
        addresses = [a.strip() for a in args.worker_addresses.split(",") if a.strip()]
    else:
        addresses = parse_endpoints(metadata("worker-network-endpoints", base=base))
    return index, addresses


def worker_layout(cfg, addresses: Sequence[str], config_path: str) -> dict:
    """The processes of every worker (`gke.host_layout`'s form) when the workers have these
    addresses (worker 0 first; one host: `["localhost"]`) and `config_path` holds `cfg`: each
    process also gets SIMLOOP_CONFIG, as in a GKE pod. PlanError / GkeError when the plan
    cannot run (e.g. another number of workers than `chips.accelerator` has)."""
    from launch.deploy.chips import config_plan, parse_accelerator
    from launch.deploy.gke import host_layout

    one_host = parse_accelerator(cfg.chips.accelerator).hosts == 1
    plan = config_plan(cfg, hostnames=None if one_host else list(addresses))
    layout = host_layout(
        cfg, plan, hostnames=addresses, run_dir=str(Path.cwd()), config_path=config_path
    )
    for host in layout["hosts"]:
        for p in host["processes"]:
            p["env"]["SIMLOOP_CONFIG"] = config_path
    return layout


def main(argv: Sequence[str] | None = None, *, metadata_url: str = METADATA_URL) -> int:
    """`python -m launch.deploy.tpu_worker --config FILE [--a.b VALUE ...] [--worker-index N
    --worker-addresses A,B,...] [--dry-run] -- COMMAND...` (on a TPU VM worker)."""
    from launch.config.loading import ConfigError, dump_config, load_config
    from launch.config.schema import SimloopConfig
    from launch.deploy.chips import PlanError, parse_accelerator
    from launch.deploy.gke import GkeError
    from launch.deploy.gke_pod import launch_until_signalled

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(
            "usage: python -m launch.deploy.tpu_worker --config FILE [--section.key VALUE] "
            "[--worker-index N --worker-addresses A,B,...] [--dry-run] -- COMMAND...",
            file=sys.stderr,
        )
        return EXIT_USAGE
    cut = argv.index("--")
    own, command = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m launch.deploy.tpu_worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="the config `tpu-vm run` was given")
    parser.add_argument("--worker-index", type=int, help="default: the metadata server's")
    parser.add_argument(
        "--worker-addresses",
        help="comma-separated, worker 0 first (default: "
        "the metadata server's worker-network-endpoints)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print this worker's processes as JSON, start nothing",
    )
    parser.add_argument("--grace-s", type=float, default=20.0, help="SIGTERM -> SIGKILL wait")
    parser.add_argument(
        "--libtpu-lockfile",
        default=str(LIBTPU_LOCKFILE),
        help="libtpu's lock, removed first when stale ('' leaves it)",
    )
    args, overrides = parser.parse_known_args(own)
    if not command:
        return _fail("give the command after --")
    try:
        cfg = load_config(SimloopConfig, args.config, overrides)
        acc = parse_accelerator(cfg.chips.accelerator)
        index, addresses = _identity(args, acc.hosts, metadata_url)
    except (ConfigError, PlanError) as e:
        return _fail(str(e))
    except (OSError, ValueError) as e:  # the metadata server: unreachable, or odd answers
        return _fail(
            f"cannot tell which TPU VM worker this is ({type(e).__name__}: {e}): run "
            "it on a TPU VM worker, or pass --worker-index and --worker-addresses"
        )
    # The config with these overrides applied, for every process: a JAX server's
    # `simloop serve --config`, and SIMLOOP_CONFIG for COMMAND (as in a GKE pod).
    with tempfile.TemporaryDirectory(prefix="simloop-worker-") as tmp:
        config_path = Path(tmp) / "config.yaml"
        config_path.write_text(dump_config(cfg))
        try:
            layout = worker_layout(cfg, addresses, str(config_path))
        except (PlanError, GkeError) as e:
            return _fail(str(e))
        if not 0 <= index < len(layout["hosts"]):
            return _fail(f"worker {index} is outside the plan's {len(layout['hosts'])} hosts")
        if args.dry_run:
            host = layout["hosts"][index]
            for p in host["processes"]:
                p["command"] = list(p.get("command") or command)
            print(json.dumps(host, indent=1))
            return 0
        if acc.is_tpu and args.libtpu_lockfile:
            # A worker's lock may be held by a live earlier run: only a stale one goes.
            from serving.vllm.launcher import clear_stale_libtpu_lock

            clear_stale_libtpu_lock(args.libtpu_lockfile)
        return launch_until_signalled(
            layout,
            index,
            command,
            lockfile=None,
            grace_s=args.grace_s,
            signals=(signal.SIGTERM, signal.SIGINT, signal.SIGHUP),
        )


def _fail(message: str) -> int:
    print(f"python -m launch.deploy.tpu_worker: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
