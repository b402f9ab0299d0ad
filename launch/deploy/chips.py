"""The chip partition planner: which chips of a TPU slice (or fake CPU devices) each role gets,
and the environment every process needs to see only its own (docs/architecture.md §5).

    simloop plan-chips --accelerator v6e-8 --roles policy_train=4,agent_serve=2,sim_serve=2
    simloop plan-chips --accelerator v6e-8 --roles policy_train=4,agent_serve=1,sim_serve=1 \
        --replicas agent_serve=2,sim_serve=2     # two 1-chip servers per role
    simloop plan-chips --config configs/v6e-8.yaml --format env

A host's chips form a grid (v6e-8: 2 x 4; chip id = x * 4 + y). A process may own a legal
rectangular sub-slice of it: 1, 2 or 4 chips along a row (bounds `1,1,1`, `1,2,1`, `1,4,1`),
or whole rows (`2,4,1`, the host). libtpu refuses other shapes or, worse, treats the process
as owning the host and takes its lock (`2,2,1` on a v6e-8), so the planner only hands out
those blocks, aligned, largest first (buddy allocation: any request of legal sizes that fits
the chips is placed). Multi-host slices (v6e-16 and up: 4-chip hosts in a host grid) give a
role either a legal block inside one host, or whole hosts forming a rectangle of the host
grid: one process per host, tied together by `TPU_PROCESS_BOUNDS` and
`TPU_PROCESS_ADDRESSES`. A server role may have R replicas: R processes of its chip count,
each placed like a role of its own (own chips, TPU process port, HTTP port and compile cache)
and numbered by `replica`. `cpu-N` plans N fake devices the same way: tests and the CPU demo run
the plan that a v6e would.

A trainer role on several hosts is one JAX job of several processes, so each of its processes
also gets `launch/distributed.py`'s contract: SIMLOOP_COORDINATOR (the group's first host at
the group's coordinator port), SIMLOOP_NUM_PROCESSES (the group's hosts) and SIMLOOP_PROCESS_ID
(its rank, = CLOUD_TPU_TASK_ID). Coordinator ports continue after the TPU process ports: the
k-th such group listens on `tpu_port_base` + (process groups) + k, and the plan is refused when
those ports meet the servers' HTTP ports. A role on one host gets no contract: a one-process
job. (`cpu-N` plans are one host; the local launcher sets the contract there.)
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from launch.distributed import DEVICE_COUNT_FLAG, ProcessEnv

# Chips per slice -> (x, y) of the slice for the 2D families (v5e, v6e).
_TOPOLOGY_2D = {
    1: (1, 1),
    4: (2, 2),
    8: (2, 4),
    16: (4, 4),
    32: (4, 8),
    64: (8, 8),
    128: (8, 16),
    256: (16, 16),
}
_FAMILIES = {
    # prefix: (generation, GKE accelerator label, TensorCores per chip in the name)
    "v6e": ("v6e", "tpu-v6e-slice", 1),
    "v5litepod": ("v5e", "tpu-v5-lite-podslice", 1),
    "v5p": ("v5p", "tpu-v5p-slice", 2),
}


class PlanError(ValueError):
    """A plan that cannot run; the message says what would."""


@dataclass(frozen=True)
class Accelerator:
    """A TPU slice type (or `cpu-N`): its chips, hosts and their grids."""

    name: str
    generation: str
    """`v6e`, `v5e`, `v5p` or `cpu`."""
    chips: int
    host_grid: tuple[int, int, int]
    """Chips of one host along x, y, z (`TPU_CHIPS_PER_PROCESS_BOUNDS` of a whole host)."""
    hosts_grid: tuple[int, int, int]
    """Hosts of the slice along x, y, z."""
    topology: str
    """The slice topology as GKE and gcloud write it (`2x4`, `4x4`, `2x2x2`)."""
    gke_accelerator: str | None = None

    @property
    def chips_per_host(self) -> int:
        x, y, z = self.host_grid
        return x * y * z

    @property
    def hosts(self) -> int:
        x, y, z = self.hosts_grid
        return x * y * z

    @property
    def is_tpu(self) -> bool:
        return self.generation != "cpu"


def parse_accelerator(name: str) -> Accelerator:
    """`v6e-8`, `v6e-32`, `v5litepod-4`, `v5p-16` (TensorCores: 8 chips), `cpu-8`."""
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", str(name))
    known = "v6e-{1,4,8,16,32,64,128,256}, v5litepod-{1,4,8,...,256}, v5p-{8,16,32,...}, cpu-N"
    if not m:
        raise PlanError(f"accelerator {name!r} is not understood: one of {known}")
    family, count = m.group(1), int(m.group(2))
    if family == "cpu":
        if count < 1 or count & (count - 1):
            raise PlanError(f"accelerator {name!r}: cpu-N takes N = 1, 2, 4, 8, ... devices")
        grid = _TOPOLOGY_2D.get(count, (1, count)) if count <= 8 else (count // 8, 8)
        return Accelerator(name, "cpu", count, (*grid, 1), (1, 1, 1), f"{grid[0]}x{grid[1]}")
    if family not in _FAMILIES:
        raise PlanError(f"accelerator {name!r}: unknown family {family!r}; one of {known}")
    generation, label, cores_per_chip = _FAMILIES[family]
    if family == "v5p":
        chips = count // cores_per_chip
        if count % 8 or chips & (chips - 1):
            raise PlanError(
                f"accelerator {name!r}: v5p-N counts TensorCores (2 per chip): N = 8, 16, "
                f"32, ... (v5p-8 is 4 chips on one host)"
            )
        x, y, z = _v5p_topology(chips)
        hx, hy, hz = x // 2, y // 2, z
        return Accelerator(
            name, generation, chips, (2, 2, 1), (hx, hy, hz), f"{2 * hx}x{2 * hy}x{hz}", label
        )
    if count not in _TOPOLOGY_2D:
        raise PlanError(f"accelerator {name!r}: {family} slices have {sorted(_TOPOLOGY_2D)} chips")
    x, y = _TOPOLOGY_2D[count]
    if count <= 8:  # one host holds the whole slice
        return Accelerator(name, generation, count, (x, y, 1), (1, 1, 1), f"{x}x{y}", label)
    return Accelerator(name, generation, count, (2, 2, 1), (x // 2, y // 2, 1), f"{x}x{y}", label)


def _v5p_topology(chips: int) -> tuple[int, int, int]:
    """The 3D torus of a v5p slice: 2x2x1 (one host), 2x2x2, 2x2x4, then y, x and z double in
    turn (2x4x4, 4x4x4, 4x4x8, 4x8x8, ...). Hosts hold 2x2x1 chips."""
    dims, turn = [2, 2, 1], 0
    while dims[0] * dims[1] * dims[2] < chips:
        if dims[2] < 4:
            dims[2] *= 2
        else:
            dims[(1, 0, 2)[turn % 3]] *= 2
            turn += 1
    return dims[0], dims[1], dims[2]


@dataclass(frozen=True)
class ProcessPlan:
    """One process of the plan: where it runs and the environment it must start with."""

    role: str
    kind: str
    """`serve` (roles ending in `_serve`) or `train`."""
    host: int
    chips: tuple[int, ...]
    """Chip ids on its host (`TPU_VISIBLE_CHIPS`); on `cpu-N`, device ids."""
    bounds: tuple[int, int, int]
    """`TPU_CHIPS_PER_PROCESS_BOUNDS`."""
    rank: int = 0
    """Index within its role's process group (`CLOUD_TPU_TASK_ID`)."""
    group_size: int = 1
    """Processes of its role's group (one per host for multi-host roles)."""
    http_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    replica: int = 0
    """Which of its role's replicas (server roles may have several; each its own group)."""
    hostname: str = "localhost"
    """Its host's name: the `hostnames` given to the planner, else `localhost` (one host) or
    `host-<i>`, standing for host i's address."""
    coordinator: str | None = None
    """HOST:PORT of its group's JAX coordinator (`SIMLOOP_COORDINATOR`) for a trainer group
    spanning several hosts; None for a one-process group."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["chips"], d["bounds"] = list(self.chips), list(self.bounds)
        return d


@dataclass(frozen=True)
class ChipPlan:
    accelerator: Accelerator
    processes: list[ProcessPlan]

    def role(self, role: str) -> list[ProcessPlan]:
        return [p for p in self.processes if p.role == role]

    def device_ids(self, role: str) -> list[int]:
        """Global device ids of a role (host-major): what `rl.train.mesh.role_meshes` takes in
        CPU mode, where one process holds every fake device."""
        per_host = self.accelerator.chips_per_host
        return [p.host * per_host + c for p in self.role(role) for c in p.chips]

    def to_json(self) -> str:
        return json.dumps([p.to_dict() for p in self.processes], indent=1)

    def to_env_lines(self) -> str:
        """Per process: a comment naming it, then one `export K=V` line per variable."""
        out = []
        for p in self.processes:
            chips = ",".join(map(str, p.chips))
            port = f", http port {p.http_port}" if p.http_port else ""
            job = (
                f", process {p.rank} of {p.group_size}, coordinator {p.coordinator}"
                if p.coordinator
                else ""
            )
            out.append(
                f"# {p.role} [{p.kind}] replica {p.replica} host {p.host} rank {p.rank}: "
                f"chips {chips}{port}{job}"
            )
            out += [f"export {k}={shlex.quote(v)}" for k, v in p.env.items()]
            out.append("")
        return "\n".join(out)


def _legal_blocks(grid: tuple[int, int, int]) -> dict[int, tuple[int, int, int]]:
    """Block size -> shape of the legal sub-slices of a grid: part of a y-row (powers of two
    dividing y), or whole y-rows (powers of two dividing x), or whole x-y planes along z."""
    x, y, z = grid
    out = {}
    s = 1
    while s <= y:
        if y % s == 0:
            out[s] = (1, s, 1)
        s *= 2
    m = 2
    while m <= x:
        if x % m == 0:
            out[m * y] = (m, y, 1)
        m *= 2
    k = 2
    while k <= z:
        if z % k == 0:
            out[x * y * k] = (x, y, k)
        k *= 2
    return out


def _is_serve(role: str) -> bool:
    return role.endswith("_serve") or role == "serve"


def plan_chips(
    accelerator: str | Accelerator,
    roles: Mapping[str, int],
    *,
    tpu_port_base: int = 8476,
    http_port_base: int = 8000,
    cache_dir: str = "/tmp/simloop/xla_cache",
    hostnames: Sequence[str] | None = None,
    replicas: Mapping[str, int] | None = None,
) -> ChipPlan:
    """Place every role (`replicas[role]` times, default once) on disjoint chips (see the
    module docstring); PlanError says what would work when the request cannot."""
    acc = accelerator if isinstance(accelerator, Accelerator) else parse_accelerator(accelerator)
    if not roles:
        raise PlanError("no roles to place: give role=chips pairs, e.g. policy_train=4")
    for role, n in roles.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PlanError(f"role {role!r}: {n!r} chips; give a positive number")
    replicas = dict(replicas or {})
    for role, r in replicas.items():
        if role not in roles:
            raise PlanError(f"replicas of {role!r}: no such role (roles: {_fmt(roles)})")
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise PlanError(f"role {role!r}: {r!r} replicas; give a positive number")
        if r > 1 and not _is_serve(role):
            raise PlanError(f"role {role!r}: only server roles (*_serve) have replicas")
    copies = {role: replicas.get(role, 1) for role in roles}
    total = sum(n * copies[role] for role, n in roles.items())
    if total > acc.chips:
        asked = ",".join(
            f"{r}={n}" + (f"x{copies[r]}" if copies[r] > 1 else "") for r, n in roles.items()
        )
        raise PlanError(
            f"the roles ask for {total} chips ({asked}) but a {acc.name} has {acc.chips}; "
            f"shrink a role or use a larger slice"
        )
    if hostnames is not None and len(hostnames) != acc.hosts:
        raise PlanError(f"{len(hostnames)} hostnames for a {acc.name} with {acc.hosts} hosts")
    host_blocks = _legal_blocks(acc.host_grid)
    slice_blocks = _legal_blocks(acc.hosts_grid)
    per_host = acc.chips_per_host
    legal = sorted(host_blocks) + [h * per_host for h in sorted(slice_blocks) if h > 1]
    for role, n in roles.items():
        if n not in legal:
            shapes = ", ".join(f"{s} ({_bounds(b)})" for s, b in sorted(host_blocks.items()))
            more = (
                f"; or whole hosts: {[h * per_host for h in sorted(slice_blocks) if h > 1]}"
                if acc.hosts > 1
                else ""
            )
            raise PlanError(
                f"role {role!r}: {n} chips is not a legal sub-slice of a {acc.name} "
                f"(hosts of {_grid(acc.host_grid)} chips). A process takes {shapes}{more}. "
                f"Other shapes make libtpu refuse the bounds or claim the whole host."
            )
        if _is_serve(role) and n > per_host:
            raise PlanError(
                f"role {role!r}: a server must fit on one host ({per_host} chips on a "
                f"{acc.name}); run several server roles instead of one of {n} chips"
            )
    # Buddy allocation over the slice's chips in host-major order, largest request first.
    units = [(role, r) for role in roles for r in range(copies[role])]
    free = [True] * acc.chips
    start: dict[tuple[str, int], int] = {}
    for unit in sorted(units, key=lambda u: -roles[u[0]]):
        n = roles[unit[0]]
        for s in range(0, acc.chips, n):
            if all(free[s : s + n]):
                start[unit] = s
                free[s : s + n] = [False] * n
                break
        else:  # cannot happen for power-of-two sizes that fit; kept as a guard
            raise PlanError(f"role {unit[0]!r}: no free aligned block of {n} chips ({_fmt(roles)})")

    def host_name(h: int) -> str:
        if hostnames is not None:
            return hostnames[h]
        return "localhost" if acc.hosts == 1 else f"host-{h}"

    processes: list[ProcessPlan] = []
    http_port, tpu_port = http_port_base, tpu_port_base
    # One TPU process port per group (unit), then one coordinator port per multi-host trainer.
    coordinator_port = tpu_port_base + len(units)
    for role, replica in units:
        n, s = roles[role], start[role, replica]
        kind = "serve" if _is_serve(role) else "train"
        if n <= per_host:
            groups = [(s // per_host, tuple(range(s % per_host, s % per_host + n)))]
            bounds, pbounds = host_blocks[n], (1, 1, 1)
        else:
            first = s // per_host
            groups = [(first + i, tuple(range(per_host))) for i in range(n // per_host)]
            bounds, pbounds = acc.host_grid, slice_blocks[n // per_host]
        port = tpu_port
        tpu_port += 1
        addresses = ",".join(f"{host_name(h)}:{port}" for h, _ in groups)
        coordinator = None
        if kind == "train" and len(groups) > 1:
            coordinator = f"{host_name(groups[0][0])}:{coordinator_port}"
            coordinator_port += 1
        for rank, (host, chips) in enumerate(groups):
            cache = f"{role}-{replica}" if copies[role] > 1 else role
            env = _env(acc, cache, kind, chips, bounds, pbounds, port, addresses, rank, cache_dir)
            if coordinator is not None:
                env.update(ProcessEnv(coordinator, len(groups), rank).environ())
            served = None
            if kind == "serve":
                served, http_port = http_port, http_port + 1
                env["SIMLOOP_HTTP_PORT"] = str(served)
            processes.append(
                ProcessPlan(
                    role,
                    kind,
                    host,
                    chips,
                    bounds,
                    rank,
                    len(groups),
                    served,
                    env,
                    replica,
                    host_name(host),
                    coordinator,
                )
            )
    _check_ports(tpu_port_base, coordinator_port, http_port_base, http_port)
    return ChipPlan(acc, processes)


def _check_ports(tpu_first: int, tpu_end: int, http_first: int, http_end: int) -> None:
    """The TPU process and coordinator ports [tpu_first, tpu_end) and the servers' HTTP ports
    [http_first, http_end) share each host's network (hostNetwork on GKE): they must not meet."""
    if http_first < http_end and tpu_first < http_end and http_first < tpu_end:
        raise PlanError(
            f"the TPU process and coordinator ports {tpu_first}-{tpu_end - 1} "
            f"(chips.tpu_port_base={tpu_first}) overlap the servers' HTTP ports "
            f"{http_first}-{http_end - 1} (chips.http_port_base={http_first}): move one base"
        )


def _env(acc, cache, kind, chips, bounds, pbounds, port, addresses, rank, cache_dir):
    if not acc.is_tpu:
        # One JAX process per server with its own fake devices; trainers share the process
        # that holds every device and take theirs by id (`ChipPlan.device_ids`).
        count = len(chips) if kind == "serve" else acc.chips
        env = {
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}",
            "SIMLOOP_DEVICE_IDS": ",".join(map(str, chips)),
        }
    else:
        env = {
            "TPU_VISIBLE_CHIPS": ",".join(map(str, chips)),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": _bounds(bounds),
            "TPU_PROCESS_BOUNDS": _bounds(pbounds),
            "TPU_PROCESS_PORT": str(port),
            "TPU_PROCESS_ADDRESSES": addresses,
            "CLOUD_TPU_TASK_ID": str(rank),
        }
    if kind == "serve" and acc.is_tpu:
        env["VLLM_XLA_CACHE_PATH"] = f"{cache_dir.rstrip('/')}/{cache}"
    return env


def _bounds(b: tuple[int, int, int]) -> str:
    return ",".join(map(str, b))


def _grid(b: tuple[int, int, int]) -> str:
    return "x".join(map(str, b[:2] if b[2] == 1 else b))


def _fmt(roles: Mapping[str, int]) -> str:
    return ",".join(f"{r}={n}" for r, n in roles.items())


def parse_roles(text: str) -> dict[str, int]:
    """`policy_train=4,agent_serve=2` -> {"policy_train": 4, "agent_serve": 2} (also the
    `--replicas agent_serve=2` pairs)."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        name, sep, value = part.partition("=")
        if not sep or not re.fullmatch(r"[a-z][a-z0-9_]*", name) or not value.isdigit():
            raise PlanError(f"--roles {text!r}: write role=chips pairs, e.g. policy_train=4")
        if name in out:
            raise PlanError(f"--roles {text!r}: role {name!r} appears twice")
        out[name] = int(value)
    return out


def run(args, cfg) -> int:
    """`simloop plan-chips`: print the plan of `--accelerator/--roles` (or `chips:`)."""
    import sys

    try:
        plan = config_plan(
            cfg,
            accelerator=args.accelerator,
            roles=parse_roles(args.roles) if args.roles else None,
            hostnames=args.hostnames.split(",") if args.hostnames else None,
            replicas=parse_roles(args.replicas) if args.replicas else None,
        )
    except PlanError as e:
        print(f"simloop plan-chips: {e}", file=sys.stderr)
        return 2
    print(plan.to_json() if args.format == "json" else plan.to_env_lines())
    return 0


def add_arguments(p) -> None:
    p.add_argument("--accelerator", help="v6e-8, v6e-32, v5litepod-4, v5p-8, cpu-8, ...")
    p.add_argument("--roles", help="role=chips pairs: policy_train=4,agent_serve=2,sim_serve=2")
    p.add_argument("--replicas", help="role=count pairs for server roles: agent_serve=2")
    p.add_argument("--format", choices=["json", "env"], default="json")
    p.add_argument("--hostnames", help="comma-separated host names of a multi-host slice")


# Model roles of the config -> their trainer / server roles in `chips.roles`.
TRAIN_ROLE = {"agent": "policy_train", "simulator": "sim_train"}
SERVE_ROLE = {"agent": "agent_serve", "simulator": "sim_serve"}


def config_plan(
    cfg,
    *,
    accelerator: str | Accelerator | None = None,
    roles: Mapping[str, int] | None = None,
    hostnames: Sequence[str] | None = None,
    replicas: Mapping[str, int] | None = None,
) -> ChipPlan:
    """The plan of a config's `chips:` section (accelerator, roles and replicas overridable;
    overriding the roles drops the config's replicas unless `replicas` is given)."""
    c = cfg.chips
    if replicas is None:
        replicas = c.replicas if roles is None else {}
    return plan_chips(
        accelerator or c.accelerator,
        c.roles if roles is None else roles,
        tpu_port_base=c.tpu_port_base,
        http_port_base=c.http_port_base,
        cache_dir=c.cache_dir,
        hostnames=hostnames,
        replicas=replicas,
    )


def trainer_device_ids(cfg, model_role: str, device_count: int | None = None) -> list[int] | None:
    """The device ids a CPU plan gives `model_role`'s trainer (`agent` -> `policy_train`),
    checked against the devices this process has (`device_count`; None: ask JAX); None on TPU
    (a process there sees only its own chips) or when the plan has no such role."""
    if cfg.chips.accelerator.startswith("cpu-") and TRAIN_ROLE[model_role] in cfg.chips.roles:
        plan = config_plan(cfg)
        import jax

        if jax.process_count() > 1:
            # A multi-process job is the trainer alone (its servers are processes of their
            # own): its processes' devices together are the role's, as on a TPU slice.
            want = cfg.chips.roles[TRAIN_ROLE[model_role]]
            if jax.device_count() != want:
                raise PlanError(
                    f"the job's {jax.process_count()} processes hold {jax.device_count()} "
                    f"devices but chips.roles.{TRAIN_ROLE[model_role]} is {want}"
                )
            return None
        if device_count is None:
            device_count = jax.device_count()
        if device_count < plan.accelerator.chips:
            raise PlanError(
                f"the chip plan {cfg.chips.accelerator} needs {plan.accelerator.chips} devices "
                f"but this process has {device_count}: leave XLA_FLAGS unset (simloop sets "
                f"--xla_force_host_platform_device_count from the plan) or change chips.roles"
            )
        return plan.device_ids(TRAIN_ROLE[model_role])
    return None


def trainer_tpu_env(cfg, model_role: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The planned TPU environment of `model_role`'s trainer when this process is it on a
    one-host TPU plan and nothing has pinned its chips yet (the GKE pod entry does); else {}."""
    role = TRAIN_ROLE[model_role]
    if "TPU_VISIBLE_CHIPS" in environ or role not in cfg.chips.roles:
        return {}
    try:
        plan = config_plan(cfg)
    except PlanError:  # the job reports it when it plans its servers
        return {}
    if not plan.accelerator.is_tpu or plan.accelerator.hosts != 1:
        return {}
    (proc,) = plan.role(role)
    return dict(proc.env)


def server_env(proc: ProcessPlan) -> dict[str, str]:
    """The planned environment of a server process (its devices), less its HTTP port (a
    local server picks a free one)."""
    return {k: v for k, v in proc.env.items() if k != "SIMLOOP_HTTP_PORT"}


def cpu_device_flag(cfg, environ: Mapping[str, str]) -> str | None:
    """The XLA_FLAGS value that gives this process the fake devices of a `cpu-N` plan, or None
    (not a CPU plan, or XLA_FLAGS already chooses a device count)."""
    flags = environ.get("XLA_FLAGS", "")
    if not cfg.chips.accelerator.startswith("cpu-") or "device_count" in flags:
        return None
    n = parse_accelerator(cfg.chips.accelerator).chips
    return f"{flags} {DEVICE_COUNT_FLAG}={n}".strip()
