"""The fleet router's app (mlx_fleet_router.app) against stub upstreams on 127.0.0.1, with the
routing table followed from a MemoryStore (mlx_fleet_router.follow): routing and /v1/models,
retries before the first byte (refused connection, 503), none after it, the breaker opening,
tenant limits and the backpressure queue (429 + Retry-After), 404 / 400 / 409 in OpenAI's shape,
a client disconnect cancelling the upstream request.

The stubs stand in for agents only to test the router's own behaviour; tests/test_router_e2e.py
runs it against real agents."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from mlx_fleet.capabilities import ModelCapabilities
from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys,
                                ModelSource, NodeCapacity, NodeHealth, NodeRecord,
                                ServingParams, TrafficSplit)
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.openai_errors import ErrorResponse
from mlx_fleet.routing.api_keys import KeyFile
from mlx_fleet.routing.headers import PIN_HEADER, SESSION_HEADER
from mlx_fleet.routing.split import choose
from mlx_fleet_router import breaker, limits
from mlx_fleet_router.app import STATE_KEY, build_app, usage_tokens
from mlx_fleet_router.state import RouterSettings
from mlx_fleet_router.follow import Follower
from mlx_fleet_router.picker import Candidate, Ring, pick

KEYS = Keys()
NS, DEP, MODEL = "team", "chat", "chat"
CAP = NodeCapacity(memory_total_bytes=64 << 30, memory_available_bytes=60 << 30,
                   chip="Apple M4 Max", chip_generation=4)
KEY_A = "sk-router-test-key-a-0123456789"
FORWARD = "fleet-internal-forward-key-0123"
COMPLETION = {"id": "x", "object": "chat.completion", "choices": [],
              "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


# -- stubs and rig ----------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Stub:
    """An upstream on 127.0.0.1 whose generation routes run ``handler``; ``seen`` records each
    request's headers."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.seen: list[dict[str, str]] = []
        self.healthy = True
        self.probes = 0

        async def gen(request: web.Request) -> web.StreamResponse:
            self.seen.append(dict(request.headers))
            await request.read()
            return await self.handler(request)

        async def health(request: web.Request) -> web.Response:
            self.probes += 1
            return web.json_response({"status": "ok" if self.healthy else "failed"},
                                     status=200 if self.healthy else 503)

        app = web.Application()
        app.router.add_post("/v1/chat/completions", gen)
        app.router.add_post("/v1/completions", gen)
        app.router.add_post("/v1/embeddings", gen)
        app.router.add_get("/health", health)
        self.server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


async def ok(request: web.Request) -> web.Response:
    return web.json_response(COMPLETION)


def dead_url() -> str:
    """A URL where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
async def stubs() -> AsyncIterator[Callable[[Handler], Awaitable[Stub]]]:
    started: list[Stub] = []

    async def make(handler: Handler, tls: ssl.SSLContext | None = None) -> Stub:
        stub = Stub(handler)
        await stub.server.start_server(ssl=tls)
        started.append(stub)
        return stub

    yield make
    for stub in started:
        await stub.server.close()


async def publish(store: MemoryStore, node: str, endpoint: str, revision: str = "r1", *,
                  ns: str = NS, name: str = DEP, served: str = MODEL, batch: int = 8,
                  state: AssignmentState = AssignmentState.READY,
                  health: NodeHealth = NodeHealth.HEALTHY,
                  capabilities: ModelCapabilities | None = None,
                  task: str = "TextGeneration") -> None:
    """A Mac serving ``ns/name`` at ``revision`` for ``task``: its node record, assignment and
    report (with ``capabilities``; None: unknown, as an agent older than them reports)."""
    await store.put(KEYS.node(node), NodeRecord(name=node, address=endpoint, capacity=CAP,
                                                health=health).to_json())
    await store.put(KEYS.assignment(node, ns, name, revision), Assignment(
        namespace=ns, name=name, generation=1, served_model_name=served,
        source=ModelSource(uri="file:///m", revision=revision), memory_bytes=1,
        serving=ServingParams(max_concurrent_sequences=batch), task=task).to_json())
    await store.put(KEYS.report(node, ns, name, revision), AssignmentReport(
        node=node, namespace=ns, name=name, generation=1, revision=revision, state=state,
        endpoint=endpoint, capabilities=capabilities).to_json())


class Rig:
    def __init__(self, follower: Follower, client: TestClient, registry: CollectorRegistry):
        self.follower, self.client, self.registry = follower, client, registry

    @property
    def state(self):
        return self.client.server.app[STATE_KEY]

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def chat(self, session: str = "s", *, stream: bool = False,
                   headers: dict[str, str] | None = None, model: str = MODEL):
        return await self.client.post("/v1/chat/completions", json={
            "model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]},
            headers={SESSION_HEADER: session, **(headers or {})})


@pytest.fixture
async def router(memory_store: MemoryStore) -> AsyncIterator[Callable[..., Awaitable[Rig]]]:
    made: list[tuple[asyncio.Task, TestClient]] = []

    async def make(*, settings: RouterSettings | None = None, api_keys: KeyFile | None = None,
                   forward_key: KeyFile | None = None, macs: int = 0,
                   upstream_ssl: ssl.SSLContext | None = None,
                   metrics_auth: bool = False) -> Rig:
        follower = Follower(memory_store, KEYS, namespaces={NS})
        task = asyncio.create_task(follower.run())
        await follower.wait_until(
            lambda t: MODEL in t.models and len(t.models[MODEL].replicas) >= macs)
        registry = CollectorRegistry()
        app = build_app(lambda: follower.table, registry=registry,
                        synced=lambda: follower.synced,
                        settings=settings or RouterSettings(probe_interval_seconds=0),
                        api_keys=api_keys, forward_key=forward_key,
                        upstream_ssl=upstream_ssl, metrics_auth=metrics_auth)
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        made.append((task, client))
        return Rig(follower, client, registry)

    yield make
    for task, client in made:
        await client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def session_first_on(node: str, macs: set[str]) -> str:
    """A session key whose first Mac (ring owner, nothing in flight) is ``node``."""
    ring = Ring.build(macs)
    cands = [Candidate(m, "r1") for m in macs]
    for i in range(1000):
        key = f"session-{i}"
        if pick(ring, f"{NS}/{DEP}", key, cands, now=0.0).targets[0].name == node:
            return key
    raise AssertionError(f"no session key lands on {node}")


async def error_of(resp) -> dict:
    body = await resp.read()
    return ErrorResponse.model_validate_json(body).error.model_dump()


# -- tests ------------------------------------------------------------------------------------


def test_usage_tokens() -> None:
    assert usage_tokens(json.dumps(COMPLETION).encode()) == 7
    stream = (b'data: {"choices":[]}\n\ndata: {"usage":{"prompt_tokens":2,"total_tokens":5}}'
              b'\n\ndata: [DONE]\n\n')
    assert usage_tokens(stream) == 5
    assert usage_tokens(b'data: {"choices":[]}\n\n') == 0


async def test_models_health_and_a_routed_request(memory_store, stubs, router) -> None:
    a, b = await stubs(ok), await stubs(ok)
    await publish(memory_store, "mac-a", a.url)
    await publish(memory_store, "mac-b", b.url)
    await publish(memory_store, "mac-c", dead_url(), state=AssignmentState.LOADING)
    await publish(memory_store, "mac-x", a.url, ns="elsewhere", name="other", served="other")
    rig = await router(macs=2)
    resp = await rig.client.get("/v1/models")
    assert resp.status == 200
    assert (await resp.json())["data"] == [{"id": MODEL, "object": "model", "created": 0,
                                            "owned_by": "mlx-fleet", "deployment": "team/chat",
                                            "revisions": ["r1"], "ready_replicas": 2}]
    assert (await rig.client.get("/health")).status == 200
    resp = await rig.chat()
    assert resp.status == 200 and await resp.json() == COMPLETION
    assert len(a.seen) + len(b.seen) == 1
    sent = (a.seen or b.seen)[0]
    assert PIN_HEADER not in sent  # no split: the agent serves its stable revision
    assert sent[SESSION_HEADER] == "s"
    # the same session goes to the same Mac
    for _ in range(3):
        assert (await rig.chat()).status == 200
    assert sorted((len(a.seen), len(b.seen))) == [0, 4]
    assert rig.metric("mlxfleet_router_requests_total", model=MODEL, code="200",
                      tenant="default") == 4
    assert rig.metric("mlxfleet_router_affinity_total", model=MODEL, result="kept") == 4
    text = await (await rig.client.get("/metrics")).text()
    for name in ("mlxfleet_router_request_duration_seconds", "mlxfleet_router_upstream_attempts",
                 "mlxfleet_router_in_flight_requests", "mlxfleet_router_time_to_first_token"):
        assert name in text


async def test_embeddings_are_relayed_like_the_other_routes(memory_store, stubs,
                                                            router) -> None:
    embedding = {"object": "list", "model": MODEL, "data": [
        {"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
        "usage": {"prompt_tokens": 5, "total_tokens": 5}}
    paths: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        paths.append(request.path)
        return web.json_response(embedding)

    a = await stubs(answer)
    # an embedding replica whose capabilities are unknown: its assignment's task says enough
    await publish(memory_store, "mac-a", a.url, task="TextEmbedding")
    rig = await router(macs=1)
    resp = await rig.client.post("/v1/embeddings", json={"model": MODEL, "input": ["hi"]},
                                 headers={SESSION_HEADER: "s"})
    assert resp.status == 200 and await resp.json() == embedding
    assert paths == ["/v1/embeddings"] and a.seen[0][SESSION_HEADER] == "s"
    assert rig.metric("mlxfleet_router_requests_total", model=MODEL, code="200",
                      tenant="default") == 1
    resp = await rig.client.post("/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert resp.status == 404 and (await error_of(resp))["param"] == "model"
    # a chat request to it is refused by its task, without trying the Mac (old agent or not)
    resp = await rig.chat()
    err = await error_of(resp)
    assert resp.status == 400 and (err["param"], err["code"]) == ("model", "wrong_model_task")
    assert paths == ["/v1/embeddings"]


async def test_a_draining_mac_gets_no_new_request(memory_store, stubs, router) -> None:
    a, b = await stubs(ok), await stubs(ok)
    await publish(memory_store, "mac-a", a.url, health=NodeHealth.DRAINING)
    await publish(memory_store, "mac-b", b.url)
    rig = await router(macs=2)
    for i in range(10):
        assert (await rig.chat(f"session-{i}")).status == 200
    assert (len(a.seen), len(b.seen)) == (0, 10)


async def test_split_pins_the_revision_with_the_forward_key(memory_store, stubs, router,
                                                            tmp_path: Path) -> None:
    a, b = await stubs(ok), await stubs(ok)
    await publish(memory_store, "mac-a", a.url, "r1")
    await publish(memory_store, "mac-b", b.url, "r2")
    await memory_store.put(KEYS.traffic(NS, DEP), TrafficSplit(
        namespace=NS, name=DEP, served_model_name=MODEL, stable_revision="r1",
        candidate_revision="r2", weight=100).to_json())
    (tmp_path / "fwd").write_text(FORWARD + "\n")
    rig = await router(macs=2, forward_key=KeyFile(tmp_path / "fwd"))
    await rig.follower.wait_until(lambda t: t.models[MODEL].split is not None)
    resp = await rig.chat(headers={"Authorization": "Bearer client-key"})
    assert resp.status == 200
    assert (len(a.seen), len(b.seen)) == (0, 1)  # weight 100: every session on the candidate
    assert b.seen[0][PIN_HEADER] == "r2"
    assert b.seen[0]["Authorization"] == f"Bearer {FORWARD}"  # never the client's key


async def test_no_key_to_a_plain_http_agent_on_another_host(memory_store, stubs, router,
                                                             tmp_path: Path, monkeypatch,
                                                             caplog) -> None:
    """An ``http://`` agent on another host gets neither the fleet's forward key nor the
    client's own Authorization (review of issue 19: that would put a client key on the LAN in
    cleartext; :func:`mlx_fleet.exposure.may_send_key`, the agents' own rule); the router says
    so once per agent. The other host is a name resolved to 127.0.0.1: no traffic leaves
    loopback."""
    class Loopback(aiohttp.abc.AbstractResolver):
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list:
            return [{"hostname": host, "host": "127.0.0.1", "port": port,
                     "family": socket.AF_INET, "proto": 0, "flags": socket.AI_NUMERICHOST}]

        async def close(self) -> None:
            pass

    monkeypatch.setattr(aiohttp.connector, "DefaultResolver", Loopback)
    a = await stubs(ok)
    await publish(memory_store, "mac-a", a.url.replace("127.0.0.1", "studio-1.example"))
    (tmp_path / "fwd").write_text(FORWARD + "\n")
    rig = await router(macs=1, forward_key=KeyFile(tmp_path / "fwd"))
    with caplog.at_level(logging.WARNING, logger="mlx_fleet_router.app"):
        for _ in range(2):
            assert (await rig.chat(headers={"Authorization": "Bearer client-key"})).status == 200
    assert len(a.seen) == 2 and not any("Authorization" in seen for seen in a.seen)
    said = [r.getMessage() for r in caplog.records if "not relaying" in r.getMessage()]
    assert len(said) == 1 and "studio-1.example" in said[0] and "client-key" not in said[0]


async def test_metrics_auth_and_the_host_check_of_an_open_metrics(memory_store, stubs, router,
                                                                   tmp_path: Path) -> None:
    """Review of issue 19: with metrics_auth /metrics needs a key like the API; left open on a
    keyed router, its Host is still checked (a DNS-rebinding page would read it otherwise)."""
    await publish(memory_store, "mac-a", (await stubs(ok)).url)
    (tmp_path / "keys").write_text("sk-router-metrics-0123456789\n")
    keys = KeyFile(tmp_path / "keys")
    keyed = await router(api_keys=keys, metrics_auth=True)
    assert (await keyed.client.get("/metrics")).status == 401
    keyed_read = await keyed.client.get("/metrics", headers={
        "Authorization": "Bearer sk-router-metrics-0123456789"})
    assert keyed_read.status == 200 and "mlxfleet_router" in await keyed_read.text()
    assert (await keyed.client.get("/health")).status == 200  # probes stay open
    open_ = await router(api_keys=keys)
    assert (await open_.client.get("/metrics")).status == 200
    rebound = await open_.client.get("/metrics", headers={"Host": "attacker.example"})
    assert rebound.status == 421
    assert (await open_.client.get("/health", headers={"Host": "pod-ip.example"})).status == 200


async def test_client_key_is_relayed_over_loopback_without_a_forward_key(memory_store, stubs,
                                                                          router) -> None:
    """Without --forward-key-file the client's own Authorization goes to an agent where a key
    may go (loopback here, or https://)."""
    a = await stubs(ok)
    await publish(memory_store, "mac-a", a.url)
    rig = await router(macs=1)
    assert (await rig.chat(headers={"Authorization": "Bearer client-key"})).status == 200
    assert a.seen[0]["Authorization"] == "Bearer client-key"


async def test_split_through_the_router_matches_the_agents_bucket(memory_store, stubs,
                                                                  router) -> None:
    """Each session's revision is the one the agents' own split picks for it
    (mlx_fleet.routing.split.choose), pinned on the Mac that holds it."""
    a, b = await stubs(ok), await stubs(ok)
    await publish(memory_store, "mac-a", a.url, "r1")
    await publish(memory_store, "mac-b", b.url, "r2")
    split = TrafficSplit(namespace=NS, name=DEP, served_model_name=MODEL, stable_revision="r1",
                         candidate_revision="r2", weight=30)
    await memory_store.put(KEYS.traffic(NS, DEP), split.to_json())
    rig = await router(macs=2)
    await rig.follower.wait_until(lambda t: t.models[MODEL].split is not None)
    sessions = [f"user-{i}" for i in range(40)]
    for s in sessions:
        assert (await rig.chat(s)).status == 200
    pinned = {h[SESSION_HEADER]: (h[PIN_HEADER], "a") for h in a.seen}
    pinned |= {h[SESSION_HEADER]: (h[PIN_HEADER], "b") for h in b.seen}
    expected = {s: choose(split, s).revision for s in sessions}
    assert {s: rev for s, (rev, _) in pinned.items()} == expected
    assert all((mac == "a") == (rev == "r1") for rev, mac in pinned.values())
    assert {"r1", "r2"} == set(expected.values())  # both sides drawn: the check can fail


async def test_agents_over_tls_verified_with_the_upstream_ca(memory_store, stubs, router,
                                                             tmp_path: Path) -> None:
    from etcd_tls import make_pki

    pki = make_pki(tmp_path / "pki", [])
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(pki.server.cert, pki.server.key)
    a = await stubs(ok, served)
    assert a.url.startswith("https://")
    await publish(memory_store, "mac-a", a.url)
    trusting = await router(macs=1, upstream_ssl=ssl.create_default_context(cafile=pki.ca))
    assert (await trusting.chat()).status == 200
    untrusting = await router(macs=1)  # the system's CAs do not know the private CA
    resp = await untrusting.chat()
    assert resp.status == 503 and (await error_of(resp))["code"] == "unavailable"
    assert untrusting.metric("mlxfleet_router_upstream_attempts_total", model=MODEL,
                             node="mac-a", result="connect_error") == 1
    assert len(a.seen) == 1


async def test_retry_before_the_first_byte_on_refused_connection(memory_store, stubs,
                                                                 router) -> None:
    b = await stubs(ok)
    await publish(memory_store, "mac-a", dead_url())
    await publish(memory_store, "mac-b", b.url)
    rig = await router(macs=2)
    session = session_first_on("mac-a", {"mac-a", "mac-b"})
    resp = await rig.chat(session)
    assert resp.status == 200 and await resp.json() == COMPLETION
    assert len(b.seen) == 1
    assert rig.metric("mlxfleet_router_retries_total", model=MODEL, reason="Retry") == 1
    assert rig.metric("mlxfleet_router_upstream_attempts_total", model=MODEL, node="mac-a",
                      result="connect_error") == 1
    # passive ejection: the refusing Mac's breaker opened at once; the next request of the same
    # session goes straight to mac-b
    st = rig.state.breakers["mac-a"]
    assert (st.phase, st.reason) == (breaker.Phase.OPEN, "ConnectionRefused")
    assert rig.metric("mlxfleet_router_breaker_state", node="mac-a", state="open") == 1
    assert (await rig.chat(session)).status == 200
    assert rig.metric("mlxfleet_router_upstream_attempts_total", model=MODEL, node="mac-a",
                      result="connect_error") == 1
    assert len(b.seen) == 2


async def test_retry_on_503_and_the_last_answer_relayed(memory_store, stubs, router) -> None:
    async def unavailable(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy", "type": "server_error",
                                            "param": None, "code": "unavailable"}}, status=503)

    a, b = await stubs(unavailable), await stubs(ok)
    await publish(memory_store, "mac-a", a.url)
    await publish(memory_store, "mac-b", b.url)
    rig = await router(macs=2)
    resp = await rig.chat(session_first_on("mac-a", {"mac-a", "mac-b"}))
    assert resp.status == 200 and (len(a.seen), len(b.seen)) == (1, 1)
    b.handler = unavailable  # now both fail: the last attempt's own answer comes back
    resp = await rig.chat(session_first_on("mac-a", {"mac-a", "mac-b"}))
    assert resp.status == 503
    assert (await error_of(resp))["message"] == "busy"
    assert (len(a.seen), len(b.seen)) == (2, 2)


async def test_a_mac_that_dropped_the_model_is_skipped(memory_store, stubs, router) -> None:
    """The agent's 404 (its assignment was just deleted — a drain, an unassignment — and the
    router's table is a watch event behind) is retried on the next Mac before the first byte."""
    async def gone(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "not loaded", "type": "invalid_request_error",
                                            "param": "model", "code": "model_not_found"}}, status=404)

    a, b = await stubs(gone), await stubs(ok)
    await publish(memory_store, "mac-a", a.url)
    await publish(memory_store, "mac-b", b.url)
    rig = await router(macs=2)
    resp = await rig.chat(session_first_on("mac-a", {"mac-a", "mac-b"}))
    assert resp.status == 200 and (len(a.seen), len(b.seen)) == (1, 1)


async def test_no_retry_after_the_first_byte(memory_store, stubs, router) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
        request.transport.close()  # the Mac dies mid-stream
        return resp

    a, b = await stubs(cut), await stubs(ok)
    await publish(memory_store, "mac-a", a.url)
    await publish(memory_store, "mac-b", b.url)
    rig = await router(macs=2)
    resp = await rig.chat(session_first_on("mac-a", {"mac-a", "mac-b"}), stream=True)
    assert resp.status == 200
    body = b""
    with pytest.raises(aiohttp.ClientPayloadError):  # the stream is cut short
        async for part in resp.content.iter_any():
            body += part
    assert body.startswith(b"data: ")
    assert (len(a.seen), len(b.seen)) == (1, 0)  # never retried once a byte went out
    assert rig.metric("mlxfleet_router_retries_total", model=MODEL, reason="BytesSent") == 1
    # counted as the Mac's failure (502), not as a client that left (499)
    while not rig.metric("mlxfleet_router_requests_total", model=MODEL, code="502",
                         tenant="default"):
        await asyncio.sleep(0.01)  # the handler finishes after the client saw the cut
    assert rig.state.breakers["mac-a"].window[-1].failures == 1


async def test_breaker_opens_on_errors_and_traffic_moves(memory_store, stubs, router) -> None:
    async def fail(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "boom", "type": "server_error",
                                            "param": None, "code": None}}, status=500)

    a, b = await stubs(fail), await stubs(ok)
    await publish(memory_store, "mac-a", a.url)
    await publish(memory_store, "mac-b", b.url)
    rig = await router(macs=2, settings=RouterSettings(
        probe_interval_seconds=0, breaker=breaker.BreakerConfig(min_requests=3)))
    session = session_first_on("mac-a", {"mac-a", "mac-b"})
    codes = [(await rig.chat(session)).status for _ in range(3)]
    assert codes == [500, 500, 500]  # a 500 is the Mac's answer, not retried
    st = rig.state.breakers["mac-a"]
    assert (st.phase, st.reason) == (breaker.Phase.OPEN, "ErrorRate")
    assert (await rig.chat(session)).status == 200
    assert (len(a.seen), len(b.seen)) == (3, 1)


async def test_api_keys_and_tenant_limits(memory_store, stubs, router, tmp_path: Path) -> None:
    a = await stubs(ok)
    await publish(memory_store, "mac-a", a.url)
    (tmp_path / "keys").write_text(f"{KEY_A} tenant=acme\n")
    rig = await router(macs=1, api_keys=KeyFile(tmp_path / "keys"), settings=RouterSettings(
        probe_interval_seconds=0,
        tenant_limits={"acme": limits.TenantLimits(requests_per_minute=2)}))
    resp = await rig.chat()
    assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
    assert (await error_of(resp))["code"] == "invalid_api_key"
    auth = {"Authorization": f"Bearer {KEY_A}"}
    assert [(await rig.chat(headers=auth)).status for _ in range(2)] == [200, 200]
    resp = await rig.chat(headers=auth)
    assert resp.status == 429
    assert int(resp.headers["Retry-After"]) >= 1
    err = await error_of(resp)
    assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "RequestsPerMinute" in err["message"]
    assert len(a.seen) == 2
    assert rig.metric("mlxfleet_router_rate_limited_total", tenant="acme",
                      limit="RequestsPerMinute") == 1
    assert rig.metric("mlxfleet_router_requests_total", model=MODEL, code="429",
                      tenant="acme") == 1


async def test_backpressure_queue_then_429(memory_store, stubs, router) -> None:
    release, arrived = asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        arrived.set()
        await release.wait()
        return web.json_response(COMPLETION)

    a = await stubs(slow)
    await publish(memory_store, "mac-a", a.url, batch=1)
    rig = await router(macs=1, settings=RouterSettings(
        probe_interval_seconds=0, admission_batches=1,
        queue=limits.QueueConfig(max_queued=1, max_wait_seconds=30)))
    first = asyncio.create_task(rig.chat("1"))
    await arrived.wait()  # the first request is at the Mac (its admission limit: 1)
    second = asyncio.create_task(rig.chat("2"))
    while rig.state.queued.get(f"{NS}/{DEP}", 0) < 1:
        await asyncio.sleep(0.01)
    third = await rig.chat("3")  # the queue (1) is full
    assert third.status == 429 and third.headers["Retry-After"] == "30"
    assert (await error_of(third))["code"] == "overloaded"
    assert rig.metric("mlxfleet_router_rate_limited_total", tenant="default",
                      limit="QueueFull") == 1
    release.set()
    assert [(await first).status, (await second).status] == [200, 200]
    assert len(a.seen) == 2


async def test_client_disconnect_cancels_the_upstream_request(memory_store, stubs,
                                                              router) -> None:
    cancelled = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b'data: {"choices":[]}\n\n')
                await asyncio.sleep(0.05)
        except (asyncio.CancelledError, ConnectionResetError):
            cancelled.set()
            raise

    a = await stubs(endless)
    await publish(memory_store, "mac-a", a.url)
    rig = await router(macs=1)
    resp = await rig.chat(stream=True)
    assert resp.status == 200
    await resp.content.readany()
    resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(cancelled.wait(), 10)
    while rig.state.in_flight:
        await asyncio.sleep(0.01)
    assert rig.metric("mlxfleet_router_in_flight_requests", node="mac-a") == 0


async def test_errors_in_openai_shape(memory_store, stubs, router) -> None:
    a = await stubs(ok)
    await publish(memory_store, "mac-a", a.url)
    await publish(memory_store, "mac-b", a.url, ns=NS, name="dup-1", served="dup")
    await publish(memory_store, "mac-b", a.url, ns=NS, name="dup-2", served="dup")
    rig = await router(macs=1)
    await rig.follower.wait_until(lambda t: "dup" in t.conflicts)
    resp = await rig.chat(model="nope")
    assert resp.status == 404
    err = await error_of(resp)
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert "'nope'" in err["message"]
    resp = await rig.client.post("/v1/chat/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    assert resp.status == 400 and (await error_of(resp))["code"] == "invalid_json"
    resp = await rig.client.post("/v1/completions", json=["a"])
    assert resp.status == 400 and (await error_of(resp))["code"] == "invalid_value"
    resp = await rig.client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 400 and (await error_of(resp))["param"] == "model"
    resp = await rig.chat(model="dup")
    assert resp.status == 409
    err = await error_of(resp)
    assert err["code"] == "model_name_conflict"
    assert "team/dup-1" in err["message"] and "team/dup-2" in err["message"]
    assert a.seen == []
    models = [m["id"] for m in (await (await rig.client.get("/v1/models")).json())["data"]]
    assert models == [MODEL]


async def test_health_probes_open_the_breaker_and_a_trial_closes_it(memory_store, stubs,
                                                                    router) -> None:
    a, b = await stubs(ok), await stubs(ok)
    a.healthy = False
    await publish(memory_store, "mac-a", a.url)
    await publish(memory_store, "mac-b", b.url)
    rig = await router(macs=2, settings=RouterSettings(
        probe_interval_seconds=0.05, breaker=breaker.BreakerConfig(cooldown_seconds=0.3)))

    while rig.state.breakers.get("mac-a", breaker.CLOSED).phase is not breaker.Phase.OPEN:
        await asyncio.sleep(0.05)
    st = rig.state.breakers["mac-a"]
    assert st.reason == "HealthProbes" and a.probes >= 3
    assert rig.state.breakers.get("mac-b", breaker.CLOSED).phase is breaker.Phase.CLOSED
    session = session_first_on("mac-a", {"mac-a", "mac-b"})
    assert (await rig.chat(session)).status == 200
    assert (len(a.seen), len(b.seen)) == (0, 1)  # ejected: its session went to mac-b
    a.healthy = True  # after the cooldown, a probe is the half-open trial and closes it
    while rig.state.breakers["mac-a"].phase is not breaker.Phase.CLOSED:
        await asyncio.sleep(0.05)
    assert (await rig.chat(session)).status == 200
    assert (len(a.seen), len(b.seen)) == (1, 1)


async def test_follower_rebuilds_once_per_change_burst_and_ignores_plain_stats(
        memory_store) -> None:
    """The table is rebuilt on the first read after a change; a stats report that does not
    change a guard verdict leaves it as it is; a guard trip reaches it."""
    from mlx_fleet.contract import StatsReport

    follower = Follower(memory_store, KEYS)
    task = asyncio.create_task(follower.run())
    try:
        for i in range(3):
            await publish(memory_store, f"mac-{i}", f"http://mac-{i}:8000")
        await follower.wait_until(lambda t: len(t.models[MODEL].replicas) == 3)
        builds = follower.builds
        assert follower.table is follower.table and follower.builds == builds  # no change
        for n in range(5):  # agents' periodic stats: no guard verdict in them
            rev = await memory_store.put(KEYS.stats("mac-0", NS, DEP), StatsReport(
                node="mac-0", namespace=NS, name=DEP, updated_unix=float(n)).to_json())
        await follower.stats.wait_for(rev)
        _ = follower.table  # a read rebuilds a stale table
        assert follower.builds == builds
        split = TrafficSplit(namespace=NS, name=DEP, served_model_name=MODEL,
                             stable_revision="r1", candidate_revision="r2", weight=10,
                             canary_uid="u1")
        await memory_store.put(KEYS.traffic(NS, DEP), split.to_json())
        await memory_store.put(KEYS.stats("mac-1", NS, DEP), StatsReport(
            node="mac-1", namespace=NS, name=DEP, canary_uid="u1", guard_tripped=True).to_json())
        table = await follower.wait_until(lambda t: t.models[MODEL].guard_tripped)
        assert table.models[MODEL].split == split
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_fleet_view_breakers_and_in_flight_behind_the_api_key(memory_store, stubs, router,
                                                                    tmp_path: Path) -> None:
    release, arrived = asyncio.Event(), asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        arrived.set()
        await release.wait()
        return web.json_response(COMPLETION)

    b = await stubs(held)
    await publish(memory_store, "mac-a", dead_url())
    await publish(memory_store, "mac-b", b.url)
    (tmp_path / "keys").write_text(f"{KEY_A} tenant=acme\n")
    rig = await router(macs=2, api_keys=KeyFile(tmp_path / "keys"))
    # /fleet is behind the key; /health stays minimal and open (issue 19)
    resp = await rig.client.get("/fleet")
    assert resp.status == 401 and (await error_of(resp))["code"] == "invalid_api_key"
    resp = await rig.client.get("/health")
    assert resp.status == 200 and set(await resp.json()) == {"status", "models"}
    auth = {"Authorization": f"Bearer {KEY_A}"}
    first = await (await rig.client.get("/fleet", headers=auth)).json()
    assert first == {"object": "fleet", "macs": [
        {"node": n, "state": "closed", "reason": "", "in_flight": 0,
         "half_open_in_seconds": None, "trial_in_flight": False, "deployments": ["team/chat"]}
        for n in ("mac-a", "mac-b")]}
    # a request whose session owner refuses connections: mac-a ejected, held on mac-b
    task = asyncio.create_task(rig.chat(session_first_on("mac-a", {"mac-a", "mac-b"}),
                                        headers=auth))
    await arrived.wait()
    resp = await rig.client.get("/fleet", headers=auth)
    assert resp.status == 200
    a_mac, b_mac = (await resp.json())["macs"]
    assert (a_mac["node"], a_mac["state"], a_mac["reason"], a_mac["in_flight"]) == (
        "mac-a", "open", "ConnectionRefused", 0)
    assert 0 < a_mac["half_open_in_seconds"] <= RouterSettings().breaker.cooldown_seconds
    assert (b_mac["node"], b_mac["state"], b_mac["in_flight"]) == ("mac-b", "closed", 1)
    release.set()
    assert (await task).status == 200
    after = await (await rig.client.get("/fleet", headers=auth)).json()
    assert [m["in_flight"] for m in after["macs"]] == [0, 0]


TOOLS = ModelCapabilities(tool_calling=True, tool_parser="json_tools", max_n=2,
                          max_context_tokens=4096)
PLAIN = ModelCapabilities(max_context_tokens=4096)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


async def test_a_request_needing_a_capability_goes_only_to_macs_that_have_it(
        memory_store, stubs, router) -> None:
    a, b, c = await stubs(ok), await stubs(ok), await stubs(ok)
    await publish(memory_store, "mac-a", a.url, capabilities=PLAIN)
    await publish(memory_store, "mac-b", b.url, capabilities=TOOLS)
    rig = await router(macs=2)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}
    for i in range(8):
        resp = await rig.client.post("/v1/chat/completions", json=body,
                                     headers={SESSION_HEADER: f"session-{i}"})
        assert resp.status == 200
    assert (len(a.seen), len(b.seen)) == (0, 8)
    # without tools both serve (every session key spreads over both Macs)
    for i in range(16):
        assert (await rig.chat(f"session-{i}")).status == 200
    assert len(a.seen) > 0 and len(b.seen) > 8
    # a Mac whose capabilities are unknown (an older agent) is tried: it decides itself
    await publish(memory_store, "mac-c", c.url)
    await rig.follower.wait_until(lambda t: len(t.models[MODEL].replicas) == 3)
    await publish(memory_store, "mac-b", b.url, capabilities=PLAIN)
    await rig.follower.wait_until(
        lambda t: all(r.capabilities != TOOLS for r in t.models[MODEL].replicas))
    resp = await rig.client.post("/v1/chat/completions", json=body)
    assert resp.status == 200 and len(c.seen) == 1


@pytest.mark.parametrize(("path", "extra", "param", "code", "words"), [
    ("/v1/chat/completions", {"tools": [TOOL]}, "tools", "unsupported_parameter",
     "tools: tool calling is not supported by the model 'chat'"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format",
     "unsupported_parameter", "structured outputs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, "logprobs",
     "unsupported_parameter", "logprobs is not supported"),
    # the largest n any Mac of the model offers is named
    ("/v1/completions", {"n": 3}, "n", "unsupported_value", "n = 3 is not supported by the "
                                                             "model 'chat' (at most 2)"),
    ("/v1/embeddings", {"input": "x"}, "model", "wrong_model_task",
     "model: the model 'chat' is served for TextGeneration: use POST /v1/chat/completions"),
])
async def test_no_mac_with_the_capability_is_a_400_naming_the_field_without_trying_any(
        memory_store, stubs, router, path, extra, param, code, words) -> None:
    a, b = await stubs(ok), await stubs(ok)
    await publish(memory_store, "mac-a", a.url, capabilities=PLAIN)
    # a draining Mac still counts for what the model can do: its n bound is the one named
    await publish(memory_store, "mac-b", b.url, capabilities=ModelCapabilities(max_n=2),
                  health=NodeHealth.DRAINING)
    rig = await router(macs=2)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt": "x",
            **extra}
    resp = await rig.client.post(path, json=body)
    assert resp.status == 400
    err = await error_of(resp)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
    assert words in err["message"]
    assert a.seen == [] and b.seen == []
    assert rig.metric("mlxfleet_router_requests_total", model=MODEL, code="400",
                      tenant="default") == 1


async def test_embeddings_are_routed_to_an_embedding_model(memory_store, stubs, router) -> None:
    embedded = {"object": "list", "data": [], "usage": {"prompt_tokens": 2, "total_tokens": 2}}

    async def embed(request: web.Request) -> web.Response:
        return web.json_response(embedded)

    e = await stubs(embed)
    await publish(memory_store, "mac-e", e.url, capabilities=ModelCapabilities(
        task="TextEmbedding", embeddings=True, max_context_tokens=512))
    rig = await router(macs=1)
    resp = await rig.client.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert resp.status == 200 and await resp.json() == embedded
    assert len(e.seen) == 1
    # and a chat request to it is refused by the router, naming the model
    resp = await rig.chat()
    assert resp.status == 400
    err = await error_of(resp)
    assert (err["param"], err["code"]) == ("model", "wrong_model_task")
    assert "served for TextEmbedding: use POST /v1/embeddings" in err["message"]
    assert len(e.seen) == 1
