"""Bearer API keys of the agent's HTTP API: the pure parts table-driven, the reload, the real
app (401 in OpenAI's shape, several keys, rotation without restart, /health and /metrics), a
canary request forwarded between two agents with the fleet-internal key — and, last, no key in
anything any of them logged or answered. A real agent over HTTPS and a real agent process, on a
real etcd, are in tests/test_integration_agent.py (with the same scan of what they logged)."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from etcd_tls import make_pki
from mlx_fleet.contract import Keys, NodeCapacity, Role, TrafficSplit
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.routing.api_keys import (KeyFile, KeyFileError, Stamp, bearer_token, digest,
                                        matches, parse_key_entries, parse_key_file,
                                        stamp_changed)
from mlx_fleet.routing.headers import PIN_HEADER, REVISION_HEADER
from node_agent.controller import ServedModel
from node_agent.main import Agent as NodeAgent
from node_agent.cli import AgentConfig, StartupError, build_parser, config_from_args
from node_agent.openai_api import build_app
from node_agent.registration import Registration
from node_agent.serving import ServingCore
from node_agent.traffic import TrafficManager
from serving_fixtures import (MODEL_ID, Agent, agent, other_model_path,  # noqa: F401
                              tiny_model_path)

# Every key this module uses; test_zz_* greps everything captured for them.
KEY_A = "sk-test-alpha-0123456789abcdef"
KEY_B = "sk-test-bravo-0123456789abcdef"
KEY_C = "sk-test-charlie-0123456789abcdef"  # rotated in
KEY_NODE = "sk-node-back-only-0123456789ab"  # accepted by the back node only
KEY_FLEET = "fleet-internal-0123456789abcdef"  # --forward-key-file
KEY_FLEET2 = "fleet-internal-rotated-0123456789"
SECRETS = [KEY_A, KEY_B, KEY_C, KEY_NODE, KEY_FLEET, KEY_FLEET2]
SEEN: list[str] = []  # log records, response bodies and log files captured by the tests

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(autouse=True)
def _capture_logs(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG)
    yield
    SEEN.extend(r.getMessage() + (r.exc_text or "")
                for phase in ("setup", "call") for r in caplog.get_records(phase))


def write_keys(path: Path, *keys: str, atomic: bool = True) -> Path:
    text = "# API keys\n\n" + "\n".join(keys) + "\n"
    if atomic:  # how an operator should rotate: a new file renamed over the old (new inode)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    else:
        path.write_text(text)
    return path


async def body_of(resp: aiohttp.ClientResponse) -> str:
    text = await resp.text()
    SEEN.append(text)
    SEEN.extend(f"{k}: {v}" for k, v in resp.headers.items())
    return text


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- the pure parts ---------------------------------------------------------------------------


@pytest.mark.parametrize("text,keys", [
    (f"{KEY_A}\n", (KEY_A,)),
    (f"# comment\n\n  {KEY_A}  \n\t\n{KEY_B}\r\n# {KEY_C}\n", (KEY_A, KEY_B)),
    (f"{KEY_A}\n{KEY_B}\n{KEY_A}\n", (KEY_A, KEY_B)),  # duplicates once, file order kept
    ("x" * 16, ("x" * 16,)),
    ("x" * 512, ("x" * 512,)),
])
def test_parse_key_file(text: str, keys: tuple[str, ...]) -> None:
    assert parse_key_file(text) == keys


@pytest.mark.parametrize("text,message", [
    ("", "no key in the file (one key per line; '#' starts a comment)"),
    ("# only a comment\n\n", "no key in the file (one key per line; '#' starts a comment)"),
    (f"{KEY_A}\nshort\n", "line 2: a key has 16 to 512 characters, this one has 5"),
    ("x" * 513, "line 1: a key has 16 to 512 characters, this one has 513"),
    (f"\n{KEY_A} {KEY_B}\n", "line 2: a key is printable ASCII without spaces"),
    (f"{KEY_A}\tx\n", "line 1: a key is printable ASCII without spaces"),
    (f"{KEY_A}é\n", "line 1: a key is printable ASCII without spaces"),
])
def test_parse_key_file_refuses_naming_the_line_not_the_key(text: str, message: str) -> None:
    with pytest.raises(KeyFileError) as e:
        parse_key_file(text)
    assert str(e.value) == message
    assert KEY_A not in str(e.value) and KEY_B not in str(e.value)


@pytest.mark.parametrize("text,entries", [
    (f"{KEY_A}\n", ((KEY_A, "default"),)),
    (f"{KEY_A} tenant=acme\n  {KEY_B}\ttenant=b-2  \n{KEY_C}\n",
     ((KEY_A, "acme"), (KEY_B, "b-2"), (KEY_C, "default"))),
    (f"{KEY_A} tenant=acme\n{KEY_A} tenant=other\n", ((KEY_A, "acme"),)),  # first one wins
    (f"{KEY_A} tenant={'a' * 63}\n", ((KEY_A, "a" * 63),)),
])
def test_parse_key_entries_with_tenants(text: str, entries: tuple) -> None:
    assert parse_key_entries(text) == entries
    assert parse_key_file(text) == tuple(k for k, _ in entries)  # the agent's view: keys only


@pytest.mark.parametrize("text,message", [
    (f"{KEY_A} tenant=\n", "line 1: a tenant name is a DNS label"),
    (f"{KEY_A} tenant=Acme\n", "line 1: a tenant name is a DNS label"),
    (f"{KEY_A} tenant=-a\n", "line 1: a tenant name is a DNS label"),
    (f"{KEY_A} tenant={'a' * 64}\n", "line 1: a tenant name is a DNS label"),
    (f"{KEY_A} tenant=a extra\n", "line 1: a key is printable ASCII without spaces"),
    (f"{KEY_A} x tenant=a\n", "line 1: a key is printable ASCII without spaces"),
])
def test_parse_key_entries_refuses_a_bad_tenant(text: str, message: str) -> None:
    with pytest.raises(KeyFileError) as e:
        parse_key_entries(text)
    assert str(e.value).startswith(message)
    assert KEY_A not in str(e.value)


def test_key_file_tenant_of_follows_a_rotation(tmp_path: Path) -> None:
    path = write_keys(tmp_path / "keys", f"{KEY_A} tenant=acme", KEY_B)
    keys = KeyFile(path)
    assert [keys.tenant_of(k) for k in (KEY_A, KEY_B, KEY_C, None)] == \
        ["acme", "default", None, None]
    write_keys(path, f"{KEY_C} tenant=c")
    assert [keys.tenant_of(k) for k in (KEY_A, KEY_C)] == [None, "c"]


@pytest.mark.parametrize("header,token", [
    (None, None), ("", None), ("Bearer", None), ("Bearer ", None), ("Basic abc", None),
    (f"Bearer {KEY_A}", KEY_A), (f"bearer {KEY_A}", KEY_A), (f"BEARER   {KEY_A} ", KEY_A),
    (KEY_A, None),
])
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


@pytest.mark.parametrize("presented,ok", [
    (KEY_A, True), (KEY_B, True), (KEY_C, False), (None, False), ("", False),
    (KEY_A[:-1], False), (KEY_A + "x", False), (KEY_A.upper(), False),
])
def test_matches_any_of_several_keys(presented: str | None, ok: bool) -> None:
    assert matches(presented, [digest(KEY_A), digest(KEY_B)]) is ok
    assert matches(presented, []) is False


def test_matches_compares_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early exit: a match on the first key still compares all the others."""
    import hmac

    import mlx_fleet.routing.api_keys as mod
    calls: list[bytes] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(mod.hmac, "compare_digest", spy)
    digests = [digest(k) for k in (KEY_A, KEY_B, KEY_C)]
    assert matches(KEY_A, digests)
    assert calls == digests


@pytest.mark.parametrize("last,now,changed", [
    (None, Stamp(1, 10, 5, 5), True),
    (Stamp(1, 10, 5, 5), Stamp(1, 10, 5, 5), False),
    (Stamp(1, 10, 5, 5), Stamp(2, 10, 5, 5), True),   # renamed over: a new inode
    (Stamp(1, 10, 5, 5), Stamp(1, 11, 5, 5), True),   # another size
    (Stamp(1, 10, 5, 5), Stamp(1, 10, 6, 5), True),   # rewritten in place
    (Stamp(1, 10, 5, 5), Stamp(1, 10, 5, 6), True),   # touched metadata (mtime restored)
])
def test_stamp_changed(last: Stamp | None, now: Stamp, changed: bool) -> None:
    assert stamp_changed(last, now) is changed


# -- KeyFile: reload on change, last good set kept --------------------------------------------


def test_key_file_reloads_on_change_and_keeps_the_last_good_keys(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_keys(tmp_path / "keys", KEY_A, KEY_B)
    kf = KeyFile(path)
    assert KEY_A not in repr(kf) and repr(kf) == f"KeyFile({str(path)!r}, 2 keys)"
    assert kf.current() == (digest(KEY_A), digest(KEY_B)) and kf.first == KEY_A
    assert kf.current() is kf.current()  # unchanged: not re-read

    write_keys(path, KEY_C)  # atomic replace
    assert kf.current() == (digest(KEY_C),)
    write_keys(path, KEY_A, atomic=False)  # in place, same inode
    assert kf.current() == (digest(KEY_A),)

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]

    path.unlink()  # unreadable: the last good keys stay, one error however often it is asked
    for _ in range(3):
        assert kf.current() == (digest(KEY_A),)
    assert errors() == [f"--api-key-file {str(path)!r}: cannot read (No such file or "
                        f"directory); keeping the 1 key(s) read before"]
    path.write_text(f"{KEY_B}\nbad key here\n")  # invalid: still the last good keys
    assert kf.current() == (digest(KEY_A),)
    assert len(errors()) == 1  # still the same failing episode
    write_keys(path, KEY_B)
    assert kf.current() == (digest(KEY_B),)
    path.write_text("")  # empty: an error again (a new episode), the last good keys stay
    assert kf.current() == (digest(KEY_B),)
    assert errors()[1] == (f"--api-key-file {str(path)!r}: no key in the file (one key per "
                           f"line; '#' starts a comment); keeping the 1 key(s) read before")


@pytest.mark.parametrize("content,reason", [
    (None, "cannot read (No such file or directory)"),
    ("", "no key in the file (one key per line; '#' starts a comment)"),
    (b"\xff\xfe", "not UTF-8 text"),
    (f"{KEY_A}\n{KEY_B} extra\n", "line 2: a key is printable ASCII without spaces"),
])
def test_key_file_that_cannot_be_used_at_start(tmp_path: Path, content: str | bytes | None,
                                                reason: str) -> None:
    path = tmp_path / "keys"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(KeyFileError) as e:
        KeyFile(path, flag="--forward-key-file")
    assert str(e.value) == f"--forward-key-file {str(path)!r}: {reason}"
    SEEN.append(str(e.value))


# -- flags --------------------------------------------------------------------------------------


def test_flags(tmp_path: Path) -> None:
    p = build_parser()
    help_text = p.format_help()
    for flag in ("--api-key-file", "--forward-key-file", "--metrics-auth", "--tls-cert-file",
                 "--tls-key-file", "--forward-ca-file"):
        assert flag in help_text
    keys = write_keys(tmp_path / "keys", KEY_A)
    cfg = config_from_args(p.parse_args(["--api-key-file", str(keys), "--metrics-auth",
                                         "api-key"]))
    assert (cfg.api_key_file, cfg.metrics_auth) == (str(keys), "api-key")
    # review of issue 19: /metrics needs a key by default once there are keys; open explicitly
    assert config_from_args(p.parse_args(["--api-key-file", str(keys)])).metrics_auth == \
        "api-key"
    assert config_from_args(p.parse_args(["--api-key-file", str(keys), "--metrics-auth",
                                          "open"])).metrics_auth == "open"
    assert config_from_args(p.parse_args([])).metrics_auth == "open"
    for argv, message in (
            (["--metrics-auth", "api-key"], "--metrics-auth api-key needs --api-key-file"),
            (["--tls-cert-file", "c.pem"], "--tls-cert-file and --tls-key-file go together")):
        with pytest.raises(ValueError, match=message):
            config_from_args(p.parse_args(argv))
    with pytest.raises(StartupError) as e:
        NodeAgent(AgentConfig(node_name="n", api_key_file=str(tmp_path / "missing")))
    assert str(e.value).startswith("--api-key-file ") and "cannot read" in str(e.value)
    with pytest.raises(StartupError) as e:
        NodeAgent(AgentConfig(node_name="n", tls_cert_file=str(keys), tls_key_file=str(keys)))
    assert str(e.value).startswith(f"--tls-cert-file {str(keys)!r} / --tls-key-file")
    assert KEY_A not in str(e.value)
    with pytest.raises(StartupError) as e:
        NodeAgent(AgentConfig(node_name="n", forward_ca_file=str(tmp_path / "missing")))
    assert str(e.value) == (f"--forward-ca-file {str(tmp_path / 'missing')!r}: cannot use "
                            f"(No such file or directory)")


# -- the real app -------------------------------------------------------------------------------


AppFactory = Callable[..., Awaitable[TestClient]]


@pytest_asyncio.fixture
async def keyed_app(agent: Agent) -> AsyncIterator[AppFactory]:  # noqa: F811
    """The real app over the session's serving core (tiny model loaded), with keys."""
    clients: list[TestClient] = []

    async def make(api_keys: KeyFile | None, *, forward_keys: KeyFile | None = None,
                   metrics_auth: bool = False) -> TestClient:
        app = build_app(agent.core, health=lambda: (True, {"status": "ok"}),
                        registry=agent.registry, api_keys=api_keys, forward_keys=forward_keys,
                        metrics_auth=metrics_auth)
        c = TestClient(TestServer(app, host="127.0.0.1"))
        await c.start_server()
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


async def test_missing_or_wrong_key_is_a_401_in_openai_shape(keyed_app: AppFactory,
                                                             tmp_path: Path) -> None:
    c = await keyed_app(KeyFile(write_keys(tmp_path / "keys", KEY_A, KEY_B)))
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    cases = [({}, "You didn't provide an API key"),
             ({"Authorization": KEY_A}, "You didn't provide an API key"),  # no scheme
             ({"Authorization": f"Basic {KEY_A}"}, "You didn't provide an API key"),
             (bearer(KEY_C), "Incorrect API key provided."),
             (bearer(KEY_A + "x"), "Incorrect API key provided.")]
    for headers, message in cases:
        for method, path in (("POST", CHAT), ("POST", COMPLETIONS), ("GET", "/v1/models"),
                             ("GET", "/v1/nothing-here"), ("GET", "/metrics-not")):
            resp = await c.request(method, path, json=body, headers=headers)
            text = await body_of(resp)
            assert resp.status == 401, (path, text)
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            err = (await resp.json())["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert (err["type"], err["param"], err["code"]) == (
                "invalid_request_error", None, "invalid_api_key")
            assert err["message"].startswith(message)
            for secret in SECRETS:
                assert secret not in text
    # the official client sees an AuthenticationError
    client = openai.AsyncOpenAI(base_url=str(c.make_url("/v1")), api_key=KEY_C, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        await client.models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    SEEN.append(str(e.value))
    await client.close()


async def test_each_of_several_keys_works_and_rotation_needs_no_restart(
        keyed_app: AppFactory, tmp_path: Path) -> None:
    path = write_keys(tmp_path / "keys", KEY_A, KEY_B)
    c = await keyed_app(KeyFile(path))
    base = str(c.make_url("/v1"))

    async def chat(key: str) -> str:
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        try:
            r = await client.chat.completions.create(
                model=MODEL_ID, messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
            return r.choices[0].message.role
        except openai.AuthenticationError as e:
            SEEN.append(str(e))
            return "401"
        finally:
            await client.close()

    assert [await chat(k) for k in (KEY_A, KEY_B, KEY_C)] == ["assistant", "assistant", "401"]
    write_keys(path, KEY_B, KEY_C)  # rotate: A out, C in — the very next request sees it
    assert [await chat(k) for k in (KEY_A, KEY_B, KEY_C)] == ["401", "assistant", "assistant"]
    path.unlink()  # the file goes away: the last good keys stay in force
    assert [await chat(k) for k in (KEY_A, KEY_B, KEY_C)] == ["401", "assistant", "assistant"]


async def test_health_is_open_and_metrics_as_configured(keyed_app: AppFactory, agent: Agent,  # noqa: F811
                                                        tmp_path: Path) -> None:
    kf = KeyFile(write_keys(tmp_path / "keys", KEY_A))
    for metrics_auth in (False, True):
        c = await keyed_app(kf, metrics_auth=metrics_auth)
        resp = await c.get("/health")
        assert resp.status == 200 and (await resp.json()) == {"status": "ok"}
        resp = await c.get("/metrics")
        await body_of(resp)
        assert resp.status == (401 if metrics_auth else 200)
        resp = await c.get("/metrics", headers=bearer(KEY_A))
        text = await body_of(resp)
        assert resp.status == 200 and "mlxfleet_agent_requests_total" in text
    # without a key file everything is open, as before
    c = await keyed_app(None)
    assert (await c.get("/v1/models")).status == 200
    assert (await c.get("/metrics")).status == 200
    # a refused request is counted like any other answer, without a model label
    assert agent.registry.get_sample_value("mlxfleet_agent_requests_total", {
        "model": "unknown", "revision": "unknown", "endpoint": "/metrics", "code": "401"}) >= 1


# -- forwarding between two agents carries the fleet-internal key -----------------------------

CANARY_MODEL = "canary-tiny"
NS, DEP = "default", "canary"


@pytest_asyncio.fixture(scope="module")
async def canary_core(tiny_model_path: Path,  # noqa: F811
                      other_model_path: Path) -> AsyncIterator[ServingCore]:  # noqa: F811
    core = ServingCore(registry=CollectorRegistry())
    await core.start()
    for rev, path in (("r1", tiny_model_path), ("r2", other_model_path)):
        await core.load_model(CANARY_MODEL, path, revision=rev, max_context_tokens=8192)
    yield core
    await core.close()


async def _capacity() -> NodeCapacity:
    return NodeCapacity(memory_total_bytes=64 * 2**30, memory_available_bytes=48 * 2**30,
                        chip="Apple M3 Max", chip_generation=3, simulated=True)


async def test_forwarded_request_carries_the_fleet_internal_key(
        memory_store: MemoryStore, keys: Keys, canary_core: ServingCore, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A canary candidate held by another node, over HTTPS from a private CA: the front node
    forwards with the first key of its --forward-key-file, not the client's key (the back node
    does not even know the client's key); without a forward key the back node refuses the
    forwarded request. On the in-memory store: the nodes' traffic managers need a store, not
    etcd."""
    from node_agent.main import forward_tls_context, tls_context

    pki = make_pki(tmp_path / "pki", [])
    SECRETS.extend(pki.secrets())
    trusting = forward_tls_context(str(pki.ca))
    client_keys = KeyFile(write_keys(tmp_path / "client-keys", KEY_A))
    back_keys = KeyFile(write_keys(tmp_path / "back-keys", KEY_NODE))
    fleet_path = write_keys(tmp_path / "fleet-keys", KEY_FLEET)
    fleet = KeyFile(fleet_path, flag="--forward-key-file")
    started: list[tuple[Registration, TrafficManager, TestClient]] = []

    async def node(k: Keys, name: str, served: dict[str, Role], api_keys: KeyFile,
                   forward_keys: KeyFile | None, tls: ssl.SSLContext | None = None
                   ) -> TestClient:
        reg = Registration(memory_store, k, node_name=name, address="http://unused", ttl=5,
                           capacity=_capacity)
        await reg.start()
        tm = TrafficManager(memory_store, k, node_name=name, registration=reg,
                            served=lambda: {CANARY_MODEL: ServedModel(NS, DEP, dict(served))},
                            crashes=canary_core.crashes, memory_bytes=canary_core.memory_bytes)
        await tm.start()
        await asyncio.wait_for(tm.synced.wait(), 30)
        app = build_app(canary_core, health=lambda: (True, {}), registry=canary_core.registry,
                        router=lambda: tm, api_keys=api_keys, forward_keys=forward_keys,
                        forward_ssl=trusting)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server(ssl=tls)  # TestClient.start_server passes no ssl
        c = TestClient(server)
        started.append((reg, tm, c))
        return c

    try:
        back = await node(Keys(keys.root + "-back"), "holder",
                          {"r1": Role.STABLE, "r2": Role.CANDIDATE}, back_keys, fleet,
                          tls=tls_context(str(pki.server.cert), str(pki.server.key)))
        back_url = str(back.make_url("")).rstrip("/")
        assert back_url.startswith("https://")
        split = TrafficSplit(namespace=NS, name=DEP, served_model_name=CANARY_MODEL,
                             stable_revision="r1", candidate_revision="r2", weight=100,
                             canary="c", canary_uid="uid-1",
                             candidate_endpoints=[back_url])
        await memory_store.put(keys.traffic(NS, DEP), split.to_json())
        front = await node(keys, "front", {"r1": Role.STABLE}, client_keys, fleet)
        bare = await node(keys, "front-without-key", {"r1": Role.STABLE}, client_keys, None)
        body = {"model": CANARY_MODEL, "prompt": "Once upon a time", "max_tokens": 3}

        # the client's key is not valid on the back node
        resp = await back.post(COMPLETIONS, json=body, headers=bearer(KEY_A), ssl=trusting)
        assert resp.status == 401, await body_of(resp)
        # the revision pin is honoured from the fleet-internal key only: the back node's own
        # client key presenting it has it ignored (its stable revision serves), also in a stream
        for stream in (False, True):
            for key, want in ((KEY_NODE, "r1"), (KEY_FLEET, "r2")):
                resp = await back.post(COMPLETIONS, json={**body, "stream": stream},
                                       headers={**bearer(key), PIN_HEADER: "r2"}, ssl=trusting)
                text = await body_of(resp)
                assert resp.status == 200, text
                assert resp.headers[REVISION_HEADER] == want, (key == KEY_FLEET, stream)
        # forwarded, JSON and SSE: served by r2 on the back node, accepted by its fleet key
        for stream in (False, True):
            resp = await front.post(COMPLETIONS, json={**body, "stream": stream},
                                    headers=bearer(KEY_A))
            text = await body_of(resp)
            assert resp.status == 200, text
            assert resp.headers[REVISION_HEADER] == "r2"
        # the fleet key rotates: new key first on every node's file; the old stays accepted
        write_keys(fleet_path, KEY_FLEET2, KEY_FLEET)
        resp = await front.post(COMPLETIONS, json=body, headers=bearer(KEY_A))
        assert resp.status == 200 and resp.headers[REVISION_HEADER] == "r2", await body_of(resp)
        assert fleet.first == KEY_FLEET2  # the forward used the rotated key
        # a node without --forward-key-file forwards without a key: refused by the back node
        resp = await bare.post(COMPLETIONS, json=body, headers=bearer(KEY_A))
        text = await body_of(resp)
        assert resp.status == 401, text
        assert (await resp.json())["error"]["code"] == "invalid_api_key"
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        resp = await bare.post(COMPLETIONS, json=body, headers=bearer(KEY_A))
        assert resp.status == 401, await body_of(resp)
        assert [r.getMessage() for r in caplog.records if "refused a forwarded" in r.getMessage()
                ] == [f"node {back_url} refused a forwarded request (401): check that both "
                      f"nodes have the same --forward-key-file"]  # once per node
        # and a client that has no key gets nowhere near forwarding
        resp = await front.post(COMPLETIONS, json=body)
        assert resp.status == 401, await body_of(resp)
    finally:
        for reg, tm, c in reversed(started):
            await c.close()
            await tm.stop()
            await reg.stop()


# -- last: nothing captured above contains a key --------------------------------------------------


def test_zz_no_key_in_anything_logged_or_answered() -> None:
    text = "\n".join(SEEN)
    # the scan has something to scan: refusals, rotations, the agent's log
    assert "invalid_api_key" in text and "re-read" in text and "keeping the" in text
    for secret in SECRETS:
        assert secret not in text
