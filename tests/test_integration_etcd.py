"""What only the real etcd has, on a real etcd: the etcd-backed store's client (aetcd's watch
pitfalls, a parsed endpoint connecting) and etcd over mutual TLS with authentication and
least-privilege roles.

Everything a store's user relies on is the store contract (tests/test_store_contract.py, on the
real etcd and on the in-memory store); the pure parts of these two are in tests/test_store.py
(endpoint parsing) and tests/test_etcd_security.py (the permission plan, credential loading).
The TLS etcd is started with ``--client-cert-auth``, its users and roles created by the real
``mlx-fleet etcd bootstrap-auth`` command, certificates generated here (tests/etcd_tls.py).
Every log record and error message produced in this module is collected and searched for the
secrets used (the last test).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys

import pytest

from mlx_fleet.devcluster.controlplane import EtcdServerTLS, start_etcd
from mlx_fleet.etcd_credentials import PASSWORD_ENV, EtcdCredentials, load_credentials
from mlx_fleet.etcd_security import OPERATOR_USER, ROOT_USER, ROUTER_USER, agent_user, plan_auth
from mlx_fleet.store import EtcdStore, StoreError
from test_etcd_security import K, REPO

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------------------------------------
# The etcd-backed store's client (from tests/test_store.py)
# ---------------------------------------------------------------------------------------------

async def test_parsed_endpoint_connects(etcd_server) -> None:
    """What parse_endpoint makes of the real etcd's URL is a target the client can use."""
    from mlx_fleet.store import parse_endpoint

    host, port, _ = parse_endpoint(etcd_server.client_url)
    async with EtcdStore(f"http://{host}:{port}") as s:
        assert (await s.list("/nothing-here/")).items == []


async def test_a_watch_never_yields_a_key_outside_its_prefix(store, keys) -> None:
    """A misrouted watch (aetcd bound it to another watch's stream) ends with StoreError, so
    follow_prefix resumes on a fresh one instead of yielding foreign keys or going silent."""
    from mlx_fleet.store import StoreError

    class Misrouted:
        def __init__(self, events):
            self._events = events

        def __aiter__(self):
            return self._aiter()

        async def _aiter(self):
            for e in self._events:
                yield e

        async def cancel(self):
            return None

    class Kv:
        def __init__(self, key: bytes):
            self.key, self.value = key, b"{}"
            self.mod_revision = self.create_revision = self.version = 1
            self.lease = 0

    class Ev:
        kind = "PUT"

        def __init__(self, key: bytes):
            self.kv = Kv(key)

    prefix = keys.reports_prefix
    inside = (prefix + "n/ns/d/v1").encode()
    outside = (keys.assignments_prefix + "n/ns/d/v1").encode()

    async def fake_watch(key, range_end, start_revision):
        return Misrouted([Ev(inside), Ev(outside)])

    store._client.watch = fake_watch  # type: ignore[attr-defined]
    seen = []
    with pytest.raises(StoreError, match="outside the prefix"):
        async for ev in store.watch(prefix, 1):
            seen.append(ev.kv.key)
    assert seen == [inside.decode()]


async def test_cancelling_a_watch_is_bounded_when_the_client_is_stuck(store, keys, monkeypatch) -> None:
    """aetcd's watch cancel takes its watcher's lock (and a slot in a bounded request queue);
    on a broken stream that never comes. Cancelling the consumer must still finish, and close
    must still close: seen in CI as a follower cancel that hung a test for 10 minutes."""
    import mlx_fleet.store as store_module

    monkeypatch.setattr(store_module, "CLOSE_TIMEOUT_SECONDS", 0.2)
    prefix = keys.nodes_prefix
    first = asyncio.Event()

    revision = await store.put(prefix + "x", b"1")

    async def consume() -> None:
        async for _ in store.watch(prefix, revision):
            first.set()

    consumer = asyncio.create_task(consume())
    async with asyncio.timeout(10):
        await first.wait()  # the watch exists and delivers
    watcher = store._client._watcher  # type: ignore[attr-defined]
    await watcher._lock.acquire()  # what a stuck response handler holds
    consumer.cancel()
    # (not pytest.raises inside asyncio.timeout: the timeout's own CancelledError would pass)
    done, _ = await asyncio.wait({consumer}, timeout=5)
    assert done == {consumer} and consumer.cancelled()
    closing = asyncio.ensure_future(store.close())  # its watcher shutdown waits on the same
    done, _ = await asyncio.wait({closing}, timeout=5)  # lock: bounded too
    watcher._lock.release()
    assert done == {closing}


async def test_cancelling_a_watch_being_created_is_bounded_when_the_client_is_stuck(
        store, keys, monkeypatch) -> None:
    """A watch cancelled while aetcd is still creating it — waiting for etcd's "created" answer
    on a condition of its watcher's lock — while a stuck response handler holds that lock: the
    cancelled wait would have to take the lock again, forever. The cancel returns at once (seen
    in CI: a test's follower cancel that never returned, 600 s)."""
    await store.list(keys.nodes_prefix)  # connected: the watcher exists
    watcher = store._client._watcher  # type: ignore[attr-defined]
    stuck, release = asyncio.Event(), asyncio.Event()

    async def stuck_handler(response) -> None:  # holds the lock like a handler whose
        async with watcher._lock:               # request-queue put never completes
            stuck.set()
            await release.wait()

    monkeypatch.setattr(watcher, "_handle_response", stuck_handler)

    async def consume() -> None:
        async for _ in store.watch(keys.nodes_prefix, 1):
            pass

    consumer = asyncio.create_task(consume())
    async with asyncio.timeout(10):
        await stuck.wait()  # the create was sent; its answer holds the lock
    consumer.cancel()
    done, _ = await asyncio.wait({consumer}, timeout=5)
    release.set()
    assert done == {consumer} and consumer.cancelled()


# ---------------------------------------------------------------------------------------------
# A real mutual-TLS etcd with auth on
# ---------------------------------------------------------------------------------------------

TOKEN_TTL = 1  # seconds an idle simple-auth token lives (etcd --auth-token-ttl; default 300)
ROOT_PASSWORD = "root-pw-7d1f0a"
AGENT3_PASSWORD = "agent3-pw-c94e1b"
SEEN: list[str] = []  # every log line and error text of this module, for the secret scan


class _Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        SEEN.append(self.format(record))


@pytest.fixture(scope="module", autouse=True)
def _collect_logs():
    h = _Collect(level=logging.DEBUG)
    logging.getLogger().addHandler(h)
    old = logging.getLogger().level
    logging.getLogger().setLevel(logging.DEBUG)
    yield
    logging.getLogger().removeHandler(h)
    logging.getLogger().setLevel(old)


@pytest.fixture(scope="module")
def secure(binaries, tmp_path_factory):
    """(etcd, pki, workdir): TLS + --client-cert-auth etcd, bootstrapped by the CLI."""
    from etcd_tls import make_pki

    work = tmp_path_factory.mktemp("etcd-tls")
    users = [ROOT_USER, OPERATOR_USER, ROUTER_USER, agent_user("mac-1"), agent_user("mac-2"),
             "stranger"]
    pki = make_pki(work / "pki", users)
    server = start_etcd(work, binaries, "etcd-tls",
                        tls=EtcdServerTLS(pki.server.cert, pki.server.key, pki.ca),
                        extra_args=["--auth-token-ttl", str(TOKEN_TTL)])
    (work / "root.pw").write_text(ROOT_PASSWORD + "\n")
    (work / "agent3.pw").write_text(AGENT3_PASSWORD + "\n")
    root = pki.clients[ROOT_USER]
    cmd = [sys.executable, "-m", "mlx_fleet.cli", "etcd", "bootstrap-auth",
           "--etcd-endpoint", server.client_url, "--etcd-ca-file", str(pki.ca),
           "--etcd-cert-file", str(root.cert), "--etcd-key-file", str(root.key),
           "--node", "mac-1", "--node", "mac-2", "--node", "mac-3",
           "--password-file", f"root={work / 'root.pw'}",
           "--password-file", f"{agent_user('mac-3')}={work / 'agent3.pw'}"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'operator'}"}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    SEEN.extend([first.stdout, first.stderr, again.stdout, again.stderr])
    assert first.returncode == 0, first.stderr
    assert "authentication enabled" in first.stdout
    assert again.returncode == 0, again.stderr
    assert "created" not in again.stdout and "granted" not in again.stdout  # idempotent
    yield server, pki, work
    server.stop()


def creds(pki, user: str | None, *, ca=None, password: str | None = None,
          username: str | None = None) -> EtcdCredentials:
    pair = pki.clients[user] if user else None
    return load_credentials(ca_file=ca or pki.ca, cert_file=pair and pair.cert,
                            key_file=pair and pair.key, username=username,
                            environ={PASSWORD_ENV: password} if password else {})


async def refused(aw) -> str:
    with pytest.raises(StoreError) as e:
        await aw
    SEEN.append(str(e.value))
    return str(e.value)


async def test_operator_certificate_reads_and_writes_everything(secure) -> None:
    server, pki, _ = secure
    async with EtcdStore(server.client_url, credentials=creds(pki, OPERATOR_USER)) as op:
        key = K.assignment("mac-1", "ns", "m", "r1")
        await op.put(key, b"a1")
        assert (await op.get(key)).value == b"a1"
        assert [kv.key for kv in (await op.list(K.assignments_prefix)).items] == [key]
        lease = await op.grant_lease(30)
        await op.put(K.placement_epoch, b"1", lease=lease)
        assert await op.keepalive(lease) > 0
        await op.revoke_lease(lease)
        await op.delete(key)


async def test_router_certificate_follows_the_fleet_read_only(secure) -> None:
    """The fleet router's certificate: its Follower syncs every view over TLS; any write is
    refused."""
    from mlx_fleet_router.follow import Follower

    server, pki, _ = secure
    async with EtcdStore(server.client_url, credentials=creds(pki, ROUTER_USER)) as router:
        follower = Follower(router, K)
        task = asyncio.create_task(follower.run())
        try:
            await asyncio.wait_for(follower.wait_until(lambda t: True), 30)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert "permission denied" in await refused(router.put(K.traffic("ns", "m"), b"x"))
        assert "permission denied" in await refused(router.get(K.placement_epoch))


async def test_agent_certificate_works_on_its_own_keys_end_to_end(secure) -> None:
    server, pki, _ = secure
    async with EtcdStore(server.client_url, credentials=creds(pki, OPERATOR_USER)) as op, \
            EtcdStore(server.client_url, credentials=creds(pki, agent_user("mac-1"))) as agent:
        lease = await agent.grant_lease(30)
        await agent.put(K.node("mac-1"), b"{}", lease=lease)
        assert await agent.keepalive(lease) > 0
        await agent.put(K.report("mac-1", "ns", "m", "r1"), b"rep", lease=lease)
        await agent.put(K.stats("mac-1", "ns", "m"), b"st")
        await op.put(K.traffic("ns", "m"), b"w")
        assert (await agent.get(K.traffic("ns", "m"))).value == b"w"
        start = (await agent.list(K.node_assignments_prefix("mac-1"))).revision + 1
        events = agent.watch(K.node_assignments_prefix("mac-1"), start)
        first = asyncio.ensure_future(events.__anext__())
        await op.put(K.assignment("mac-1", "ns", "m", "r2"), b"a2")
        ev = await asyncio.wait_for(first, 15)
        assert (ev.type, ev.kv.key, ev.kv.value) == ("PUT", K.assignment("mac-1", "ns", "m", "r2"), b"a2")
        await events.aclose()
        assert (await op.get(K.node("mac-1"))).lease == lease
        await agent.revoke_lease(lease)
        assert await op.get(K.node("mac-1")) is None  # revoking deleted the keys it held
        await op.delete(K.assignment("mac-1", "ns", "m", "r2"))


@pytest.mark.parametrize(("what", "call"), [
    ("another node's record", lambda s: s.put(K.node("mac-2"), b"{}")),
    ("another node's report", lambda s: s.put(K.report("mac-2", "ns", "m", "r1"), b"x")),
    ("another node's stats", lambda s: s.put(K.stats("mac-2", "ns", "m"), b"x")),
    ("a node whose name extends its own", lambda s: s.put(K.node("mac-10"), b"{}")),
    ("writing its own assignments", lambda s: s.put(K.assignment("mac-1", "ns", "m", "r1"), b"x")),
    ("reading another node's assignments", lambda s: s.list(K.node_assignments_prefix("mac-2"))),
    ("reading every node record", lambda s: s.list(K.nodes_prefix)),
    ("writing traffic", lambda s: s.put(K.traffic("ns", "m"), b"x")),
    ("writing the placement epoch", lambda s: s.put(K.placement_epoch, b"9")),
    ("deleting another node's record", lambda s: s.delete(K.node("mac-2"))),
])
async def test_agent_certificate_is_refused_elsewhere(secure, what, call) -> None:
    server, pki, _ = secure
    async with EtcdStore(server.client_url, credentials=creds(pki, agent_user("mac-1"))) as agent:
        assert "permission denied" in await refused(call(agent)), what


async def test_agent_watch_of_another_nodes_assignments_is_refused(secure) -> None:
    server, pki, _ = secure
    async with EtcdStore(server.client_url, credentials=creds(pki, agent_user("mac-1"))) as agent:
        async def first_event():
            async for ev in agent.watch(K.node_assignments_prefix("mac-2"), 1):
                return ev
        await refused(asyncio.wait_for(first_event(), 15))


async def test_certificate_of_an_unknown_user_is_refused(secure) -> None:
    server, pki, _ = secure
    async with EtcdStore(server.client_url, credentials=creds(pki, "stranger")) as s:
        await refused(s.get(K.node("mac-1")))


@pytest.mark.parametrize("case", ["no client certificate", "wrong CA", "certificate from another CA",
                                  "plain http to the TLS port", "wrong password"])
async def test_bad_credentials_are_refused_with_a_clear_error(secure, case) -> None:
    server, pki, work = secure
    url = server.client_url
    if case == "no client certificate":
        c = creds(pki, None)
    elif case == "wrong CA":
        c = creds(pki, OPERATOR_USER, ca=pki.other_ca)
    elif case == "certificate from another CA":
        c = load_credentials(ca_file=pki.ca, cert_file=pki.other_client.cert,
                             key_file=pki.other_client.key)
    elif case == "plain http to the TLS port":
        c, url = None, url.replace("https://", "http://")
    else:
        c = creds(pki, "stranger", username=agent_user("mac-3"), password="not-" + AGENT3_PASSWORD)
    store = EtcdStore(url, credentials=c, timeout=5)
    try:
        message = await refused(asyncio.wait_for(_connect_and_get(store), 30))
    finally:
        await store.close()
    assert url.split("://")[1] in message and "\n" not in message.strip()
    if case == "wrong password":
        assert "authentication failed" in message
    elif case != "plain http to the TLS port":
        assert "TLS handshake failed" in message


async def _connect_and_get(store: EtcdStore) -> None:
    await store.connect()
    await store.get(K.node("mac-1"))


async def test_password_user_reauthenticates_when_its_token_is_invalidated(secure) -> None:
    """etcd drops a user's simple-auth tokens when its password is set (as an expired token is
    dropped): the next call gets ``invalid auth token``; the store re-authenticates once and the
    call succeeds — unary calls and a watch that follow_prefix resumes."""
    server, pki, _ = secure
    # --client-cert-auth makes every client present a certificate; a token, when sent, takes
    # precedence over the certificate's CN ("stranger" is no etcd user).
    c = creds(pki, "stranger", username=agent_user("mac-3"), password=AGENT3_PASSWORD)
    root = creds(pki, ROOT_USER)
    async with EtcdStore(server.client_url, credentials=c) as agent, \
            EtcdStore(server.client_url, credentials=root) as admin:
        await agent.put(K.node("mac-3"), b"1")
        token = agent._client.metadata
        await admin.apply_auth_plan(plan_auth(K, ["mac-3"]), {agent_user("mac-3"): AGENT3_PASSWORD})
        await agent.put(K.node("mac-3"), b"2")
        assert agent._client.metadata != token  # a new token was fetched
        assert (await agent.get(K.node("mac-3"))).value == b"2"
        await admin.delete(K.node("mac-3"))


async def test_password_user_survives_token_expiry_for_calls_and_watches(secure) -> None:
    """etcd runs with --auth-token-ttl 1: a client idle for longer finds its token gone. The
    idle time is measured by etcd itself (a 3 s lease expiring, seen through a watch), not by
    sleeping. Afterwards a new watch (on the stream opened with the old token) and a put both
    succeed, on a fresh token."""
    server, pki, _ = secure
    c = creds(pki, "stranger", username=agent_user("mac-3"), password=AGENT3_PASSWORD)
    async with EtcdStore(server.client_url, credentials=c) as agent, \
            EtcdStore(server.client_url, credentials=creds(pki, ROOT_USER)) as admin:
        first = agent.watch(K.node_assignments_prefix("mac-3"), 1)  # opens the watch stream
        pending = asyncio.ensure_future(first.__anext__())
        await agent.put(K.node("mac-3"), b"before")
        token = agent._client.metadata
        # Idle for a lease's TTL (3 s > TOKEN_TTL): await etcd deleting the leased key.
        marker = f"/idle-{id(agent)}"
        lease = await admin.grant_lease(3)
        rev = await admin.put(marker, b"", lease=lease)
        async for ev in admin.watch(marker, rev + 1):
            if ev.type == "DELETE":
                break
        events = agent.watch(K.node_reports_prefix("mac-3"), rev + 1)
        nxt = asyncio.ensure_future(events.__anext__())
        await admin.put(K.report("mac-3", "ns", "m", "r1"), b"after")
        ev = await asyncio.wait_for(nxt, 15)
        assert ev.kv.value == b"after"
        assert agent._client.metadata != token  # the expired token was replaced
        await agent.put(K.node("mac-3"), b"after")
        await events.aclose()
        # The first watch's stream carried the old token; it was ended (follow_prefix resumes).
        with pytest.raises(StoreError):
            await asyncio.wait_for(pending, 15)
        await admin.delete(K.report("mac-3", "ns", "m", "r1"))
        await admin.delete(K.node("mac-3"))


async def test_client_certificate_needs_no_token(secure) -> None:
    """With --client-cert-auth the CN is the user: no Authenticate call, no token to expire."""
    server, pki, _ = secure
    async with EtcdStore(server.client_url, credentials=creds(pki, agent_user("mac-1"))) as agent:
        await agent.put(K.node("mac-1"), b"x")
        assert agent._client.metadata is None
        await agent.delete(K.node("mac-1"))


async def test_real_agent_process_registers_over_tls_with_its_certificate(secure) -> None:
    """``python -m node_agent`` with --etcd-ca-file/--etcd-cert-file/--etcd-key-file: /health
    answers 200 only once the node is registered under its lease; the record is readable by
    the operator and carries the lease."""
    import types

    from mlx_fleet.devcluster.fleet import start_agent

    server, pki, work = secure
    pair = pki.clients[agent_user("mac-2")]
    cp = types.SimpleNamespace(etcd_url=server.client_url, logs_dir=work / "logs", extra=[],
                               env=lambda: {"MLX_FLEET_ETCD_ENDPOINT": server.client_url})
    agent = await asyncio.to_thread(
        start_agent, cp, "mac-2", extra_args=("--etcd-ca-file", str(pki.ca),
                                              "--etcd-cert-file", str(pair.cert),
                                              "--etcd-key-file", str(pair.key)))
    try:
        async with EtcdStore(server.client_url, credentials=creds(pki, OPERATOR_USER)) as op:
            record = await op.get(K.node("mac-2"))
            assert record is not None and record.lease != 0
            assert json.loads(record.value)["name"] == "mac-2"
    finally:
        await asyncio.to_thread(agent.process.stop)
        SEEN.append(agent.process.log_path.read_text(errors="replace"))
    assert "permission denied" not in SEEN[-1]


def test_status_command_reads_the_fleet_over_tls(secure) -> None:
    """``mlx-fleet status`` with the operator's certificate; with an agent's it is refused
    (an agent may not list every node record) with one error line, exit 1."""
    server, pki, _ = secure
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'operator'}"}

    def status(user: str) -> subprocess.CompletedProcess:
        pair = pki.clients[user]
        r = subprocess.run([sys.executable, "-m", "mlx_fleet.cli", "status",
                            "--etcd-endpoint", server.client_url, "--etcd-ca-file", str(pki.ca),
                            "--etcd-cert-file", str(pair.cert), "--etcd-key-file", str(pair.key)],
                           capture_output=True, text=True, env=env, timeout=60)
        SEEN.extend([r.stdout, r.stderr])
        return r

    ok = status(OPERATOR_USER)
    assert ok.returncode == 0, ok.stderr
    denied = status(agent_user("mac-1"))
    assert denied.returncode == 1 and "permission denied" in denied.stderr


def test_zz_no_secret_in_anything_logged_or_raised(secure) -> None:
    """Runs last in this module: every log record and error text collected above is free of the
    passwords and of every private key's material."""
    _, pki, _ = secure
    text = "\n".join(SEEN)
    assert len(SEEN) > 10 and "permission denied" in text  # the scan has something to scan
    for secret in [ROOT_PASSWORD, AGENT3_PASSWORD, *pki.secrets()]:
        assert secret not in text
