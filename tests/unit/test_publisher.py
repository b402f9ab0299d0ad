"""Weight publishing: `EnginePublisher` against two real in-process servers (`background_server`
on 127.0.0.1, tiny engines) and the `InMemoryPublisher` test double. A publish must change
what the server generates and tag it with the new version; a refused publish (path outside
the checkpoint root, wrong token, stale version) must raise and leave the server serving.
"""

import contextlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_asyncio
from flax import nnx

from rl.data import ByteTokenizer
from rl.model import Qwen3, tiny
from rl.model.params_io import save_params
from rl.model.publish import InMemoryPublisher, PublishReport, WeightPublisher
from serving.client import ClientConfig, ClientError, InferenceClient
from serving.config import EngineConfig, ServerConfig
from serving.engine import Engine
from serving.publisher import EnginePublisher
from serving.server import background_server

# The servers live for the module, on the module's event loop; so do the tests that use them.
on_servers = pytest.mark.asyncio(loop_scope="module")

TOK = ByteTokenizer()
TOKEN = "publisher-admin-token"
# Small fixed shapes: each engine compiles its own steps, and this module runs two.
ECFG = EngineConfig(
    num_slots=2,
    max_seq_len=64,
    prefill_chunk=16,
    prefill_batch=1,
    decode_steps=1,
    max_top_logprobs=0,
)
PROMPT = TOK.encode("ls -la /tmp")
GEN = 10


def make_model(seed: int) -> Qwen3:
    # A wider init than tiny()'s default: at 0.02 greedy output is one repeated byte.
    return Qwen3(tiny(initializer_range=0.3), rngs=nnx.Rngs(seed))


@dataclass
class Servers:
    a: InferenceClient
    b: InferenceClient
    root: Path
    """The servers' --checkpoint-root."""
    outside: Path
    """A valid checkpoint beside (not under) the root."""
    refused: Path
    """A valid checkpoint under the root that the refusal tests offer."""
    seeds: list[int]
    """Model seeds already used for checkpoints (each publish gets fresh weights)."""

    def checkpoint(self) -> Path:
        seed = max(self.seeds) + 1
        self.seeds.append(seed)
        return save_params(make_model(seed), self.root / f"seed-{seed}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    outside = save_params(make_model(99), tmp_path_factory.mktemp("elsewhere") / "v1")
    cfg = ServerConfig(
        host="127.0.0.1",
        port=0,
        admin_token=TOKEN,
        checkpoint_root=str(root),
        shutdown_timeout_s=5.0,
    )
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for _ in range(2):
            engine = Engine(make_model(0), TOK, ECFG)
            url = await stack.enter_async_context(background_server(engine, TOK, cfg))
            client = InferenceClient(ClientConfig(url, timeout_s=120.0, max_retries=0))
            stack.push_async_callback(client.close)
            clients.append(client)
        refused = save_params(make_model(98), root / "refused")
        yield Servers(clients[0], clients[1], root, outside, refused, seeds=[0, 98, 99])


async def greedy(client: InferenceClient):
    out = await client.complete(PROMPT, max_tokens=GEN, temperature=0.0, extra={"ignore_eos": True})
    assert len(out.token_ids) == GEN
    return out


# ----- EnginePublisher against real servers ----------------------------------------------------


@on_servers
async def test_publish_serves_the_new_weights_under_the_new_version(servers):
    before = await greedy(servers.a)
    v = before.weight_version
    assert v == await servers.a.version(token=TOKEN)
    b_version = await servers.b.version(token=TOKEN)
    ckpt = servers.checkpoint()

    report = await EnginePublisher([servers.a], token=TOKEN).publish(str(ckpt), v + 1)

    assert isinstance(report, PublishReport)
    assert report.version == v + 1 and report.path == str(ckpt)
    assert report.servers == [servers.a.cfg.base_url]
    assert report.load_s > 0 and report.first_token_s > 0
    assert report.first_token_s >= report.load_s  # the probe runs after every load
    after = await greedy(servers.a)
    assert after.weight_version == v + 1
    assert set(after.token_versions) == {v + 1}
    assert after.token_ids != before.token_ids
    assert await servers.a.version(token=TOKEN) == v + 1
    assert await servers.b.version(token=TOKEN) == b_version  # not one of this publisher's


@on_servers
async def test_publish_by_path_relative_to_the_root(servers):
    v = await servers.a.version(token=TOKEN)
    ckpt = servers.checkpoint()
    report = await EnginePublisher([servers.a], token=TOKEN, probe=False).publish(ckpt.name, v + 1)
    assert report.first_token_s is None and report.load_s > 0
    assert (await greedy(servers.a)).weight_version == v + 1


REFUSALS = [
    "outside the root",
    "relative escape",
    "wrong token",
    "same version",
    "older version",
    "missing checkpoint",
]


def _refusal(servers: Servers, case: str, v: int) -> tuple[dict, str, int, str, int]:
    """-> (publisher kwargs, path, version, expected message, HTTP status) of a publish that
    the server at version `v` must refuse."""
    ckpt = str(servers.refused)
    escape = f"../{servers.outside.parent.name}/{servers.outside.name}"
    return {
        "outside the root": ({}, str(servers.outside), v + 1, "outside the checkpoint root", 400),
        "relative escape": ({}, escape, v + 1, "outside the checkpoint root", 400),
        "wrong token": ({"token": TOKEN + "-wrong"}, ckpt, v + 1, "bearer token", 401),
        "same version": ({}, ckpt, v, "greater than the current version", 400),
        "older version": ({}, ckpt, v - 1, "greater than the current version", 400),
        "missing checkpoint": ({}, str(servers.root / "nope"), v + 1, "does not exist", 404),
    }[case]


@pytest.mark.parametrize("case", REFUSALS)
@on_servers
async def test_a_refused_publish_raises_and_the_server_keeps_serving(servers, case):
    before = await greedy(servers.a)
    v = before.weight_version
    kw, path, version, message, status = _refusal(servers, case, v)
    publisher = EnginePublisher([servers.a], **{"token": TOKEN, **kw})
    with pytest.raises(ClientError, match=message) as info:
        await publisher.publish(path, version)
    assert info.value.status == status
    after = await greedy(servers.a)  # still serving, on the same weights
    assert after.weight_version == v
    assert after.token_ids == before.token_ids
    assert await servers.a.version(token=TOKEN) == v


@on_servers
async def test_publish_to_two_servers_loads_both(servers):
    v = max(await servers.a.version(token=TOKEN), await servers.b.version(token=TOKEN)) + 1
    ckpt = servers.checkpoint()
    report = await EnginePublisher([servers.a, servers.b], token=TOKEN).publish(str(ckpt), v)
    assert report.servers == [servers.a.cfg.base_url, servers.b.cfg.base_url]
    assert report.version == v and report.load_s > 0 and report.first_token_s > 0
    a, b = await greedy(servers.a), await greedy(servers.b)
    assert a.weight_version == b.weight_version == v
    assert set(a.token_versions) == set(b.token_versions) == {v}
    assert a.token_ids == b.token_ids  # the same weights, greedy


@on_servers
async def test_a_server_that_refuses_fails_the_whole_publish(servers):
    # b moves ahead; publishing a version between the two is refused by b.
    va = await servers.a.version(token=TOKEN)
    await EnginePublisher([servers.b], token=TOKEN).publish(str(servers.checkpoint()), va + 5)
    publisher = EnginePublisher([servers.a, servers.b], token=TOKEN)
    with pytest.raises(ClientError, match="version") as info:
        await publisher.publish(str(servers.checkpoint()), va + 1)
    assert info.value.status == 400
    assert await servers.b.version(token=TOKEN) == va + 5
    assert (await greedy(servers.b)).weight_version == va + 5


def test_engine_publisher_needs_a_server():
    with pytest.raises(ValueError, match="at least one"):
        EnginePublisher([], token=TOKEN)


class _StaleServer:
    """Acknowledges every load but keeps generating with version 3."""

    cfg = SimpleNamespace(base_url="http://stale.invalid")

    def __init__(self):
        self.loads = []

    async def load_weights(self, path, version, *, token, timeout_s):
        self.loads.append((path, version, token))
        return {"version": version}

    async def complete(self, prompt, **_):
        return SimpleNamespace(weight_version=3, token_ids=[1])


async def test_the_probe_catches_a_server_that_did_not_switch():
    stale = _StaleServer()
    with pytest.raises(RuntimeError, match="published version 4 .* version 3"):
        await EnginePublisher([stale], token=TOKEN).publish("/ckpt/v4", 4)
    assert stale.loads == [("/ckpt/v4", 4, TOKEN)]
    # Unprobed, the same publish goes through: nothing checks what the server generates.
    report = await EnginePublisher([stale], token=TOKEN, probe=False).publish("/ckpt/v4", 4)
    assert report.first_token_s is None and report.servers == ["http://stale.invalid"]


# ----- the in-memory double ---------------------------------------------------------------------


async def test_in_memory_publisher_records_and_calls_back():
    seen = []
    pub = InMemoryPublisher(on_publish=lambda path, v: seen.append((path, v)))
    assert pub.version is None and pub.published == []
    r1 = await pub.publish("/ckpt/1", 1)
    r3 = await pub.publish("/ckpt/3", 3)
    assert seen == pub.published == [("/ckpt/1", 1), ("/ckpt/3", 3)]
    assert pub.version == 3
    assert (r1.version, r1.path, r3.version, r3.path) == (1, "/ckpt/1", 3, "/ckpt/3")
    assert r3.servers == ["in-memory"] and r3.load_s >= 0 and r3.first_token_s is None


@pytest.mark.parametrize("version", [2, 1])
async def test_in_memory_publisher_refuses_a_version_that_is_not_newer(version):
    seen = []
    pub = InMemoryPublisher(on_publish=lambda path, v: seen.append(v))
    await pub.publish("/ckpt/2", 2)
    with pytest.raises(ValueError, match=f"version {version} is not newer than 2"):
        await pub.publish("/ckpt/x", version)
    assert seen == [2] and pub.published == [("/ckpt/2", 2)] and pub.version == 2


async def test_in_memory_publisher_without_callback_and_a_failing_callback():
    pub = InMemoryPublisher()
    assert (await pub.publish("p", 0)).version == 0
    assert pub.version == 0

    def broken(path, version):
        raise OSError("weights unreadable")

    failing = InMemoryPublisher(on_publish=broken)
    with pytest.raises(OSError, match="unreadable"):
        await failing.publish("p", 1)
    assert failing.published == [] and failing.version is None  # not recorded


@pytest.mark.parametrize("impl", [EnginePublisher, InMemoryPublisher])
def test_publishers_match_the_protocol(impl):
    want = inspect.signature(WeightPublisher.publish)
    got = inspect.signature(impl.publish)
    assert inspect.iscoroutinefunction(impl.publish)
    assert list(got.parameters) == list(want.parameters)
    assert got.return_annotation == want.return_annotation
