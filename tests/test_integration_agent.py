"""The node agent as a process against a real etcd: what the in-memory store can't stand in for.

The logic of each part runs on the in-memory store in its own file (tests/test_agent_controller.py,
tests/test_api_keys.py, tests/test_lifecycle_agent.py, ...); here are the tests of the whole
agent — in-process (:class:`node_agent.main.Agent`, which dials etcd itself) or as
``python -m node_agent`` — with the real etcd it registers in:

- the agent end to end (registration, a load, a completion, /health on a task bug and a stopped
  core, the DEGRADED record, the lease revoked on stop) and its CLI's start-up error;
- API keys: a real agent over HTTPS, a real agent process with and without keys — and, last, no
  key in anything they logged or answered (the same scan as tests/test_api_keys.py's);
- a serving core that fails in a real agent process: the lease revoked, a non-zero exit.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import sys
import types
from pathlib import Path

import aiohttp
import openai
import pytest

from etcd_tls import make_pki
from fleet_helpers import watch_until
from mlx_fleet import supervise as supervise_module
from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, Keys, ModelSource,
                                NodeHealth, NodeRecord, Role)
from mlx_fleet.source_policy import DEV_POLICY  # models in temporary directories
from mlx_fleet.store import EtcdStore
from node_agent.cli import AgentConfig
from node_agent.main import EXIT_CORE_FAILED, Agent
from node_agent.main import Agent as NodeAgent
from test_agent_controller import TIMEOUT, assignment, settled, wait_report
from test_api_keys import KEY_A, KEY_B, KEY_C, KEY_FLEET, SECRETS, SEEN, bearer, body_of, write_keys

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _capture_logs(caplog: pytest.LogCaptureFixture):
    """What every test here logged goes to the key scan at the end (as in test_api_keys.py)."""
    caplog.set_level(logging.DEBUG)
    yield
    SEEN.extend(r.getMessage() + (r.exc_text or "")
                for phase in ("setup", "call") for r in caplog.get_records(phase))


# -- the agent end to end (from tests/test_agent_controller.py) ---------------------------------


async def test_agent_end_to_end(etcd_server, store: EtcdStore, keys: Keys,
                                test_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                caplog: pytest.LogCaptureFixture) -> None:
    # a supervised task that fails stays in its restart back-off for the rest of the test
    monkeypatch.setattr(supervise_module, "SUPERVISOR_INITIAL_BACKOFF", 3600.0)
    monkeypatch.setattr(supervise_module, "SUPERVISOR_MAX_BACKOFF", 3600.0)
    agent = Agent(AgentConfig(node_name="e2e", etcd_endpoint=etcd_server.client_url,
                              etcd_prefix=keys.root, listen_port=0, labels={"rack": "a"},
                              lease_ttl=5, simulated_memory_bytes=64 * 2**30,
                              memory_watermark=0.75, source_policy=DEV_POLICY))
    try:
        with caplog.at_level(logging.WARNING, logger="node_agent"):
            await agent.start()
        # a simulated node says so loudly at start, and in its record
        assert any(r.levelno == logging.WARNING and "capacity is SIMULATED" in r.getMessage()
                   for r in caplog.records)
        assert agent.url and agent.url.startswith("http://127.0.0.1:")
        kv = await store.get(keys.node("e2e"))
        assert kv is not None
        rec = NodeRecord.from_json(kv.value)
        assert rec.address == agent.url and rec.capacity.simulated and rec.labels == {"rack": "a"}
        assert rec.capacity.memory_total_bytes == 64 * 2**30
        # --memory-watermark: in the record for placement, and the agent's own budget
        assert rec.capacity.memory_watermark == 0.75
        assert agent.controller.budget_bytes == rec.capacity.budget_bytes() == 48 * 2**30

        a = assignment("chat", test_model_dir, model="tiny")
        await store.put(keys.assignment("e2e", "default", "chat", "r1"), a.to_json())
        r = await wait_report(store, keys.report("e2e", "default", "chat", "r1"), settled)
        assert r is not None and r.state == AssignmentState.READY and r.endpoint == agent.url

        async with aiohttp.ClientSession() as http:
            async with http.get(f"{agent.url}/health") as resp:
                body = await resp.json()
                assert resp.status == 200, body
                assert body["assignments"]["default/chat/r1"]["state"] == "Ready"
                assert {"controller:follow", "traffic:follow", "traffic:stats"} <= {
                    t["name"] for t in body["tasks"]}
            async with http.post(f"{r.endpoint}/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 3,
                    "messages": [{"role": "user", "content": "Hello"}]}) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["X-Model-Revision"] == "r1"
                out = await resp.json()
                assert out["model"] == "tiny" and out["choices"][0]["message"]["role"] == "assistant"

            # a bug in the converge worker: the task restarts after a back-off; until then 503
            crashed = asyncio.Event()

            async def converge_bug() -> None:
                crashed.set()
                raise RuntimeError("injected converge bug")

            monkeypatch.setattr(agent.controller, "_converge", converge_bug)
            await store.put(keys.assignment("e2e", "default", "chat", "r1"),
                            a.model_copy(update={"generation": 2}).to_json())
            await asyncio.wait_for(crashed.wait(), TIMEOUT)
            async with http.get(f"{agent.url}/health") as resp:
                body = await resp.json()
                assert resp.status == 503, body
                assert body["reasons"] == ["task controller:converge failed "
                                           "(RuntimeError: injected converge bug); restarting"]
                assert body["assignments"]["default/chat/r1"]["state"] == "Ready"

            # the serving core stops: /health says so too
            await agent.core.close()
            async with http.get(f"{agent.url}/health") as resp:
                body = await resp.json()
                assert resp.status == 503, body
                assert "serving core is not running" in body["reasons"]
            # ... and so does the node record, so the operator places nothing new here
            kv = await store.get(keys.node("e2e"))

            async def degraded() -> None:
                if NodeRecord.from_json(kv.value).health is NodeHealth.DEGRADED:
                    return
                async for ev in store.watch(keys.node("e2e"), kv.mod_revision + 1):
                    if ev.type == "PUT" and NodeRecord.from_json(ev.kv.value).health is NodeHealth.DEGRADED:
                        return

            await asyncio.wait_for(degraded(), TIMEOUT)
    finally:
        await agent.stop()
    # graceful stop revoked the lease: record and report are gone at once
    assert (await store.list(keys.root + "/nodes/")).items == []
    assert (await store.list(keys.root + "/reports/")).items == []


def test_listen_address_in_use_is_one_readable_line(etcd_server, keys: Keys) -> None:
    import subprocess

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "node_agent", "--node-name", "busy",
             "--etcd-endpoint", etcd_server.client_url, "--etcd-prefix", keys.root,
             "--listen", f"127.0.0.1:{port}", "--simulated-memory", "8Gi"],
            capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("mlx-fleet-agent: error: ")
    assert f"127.0.0.1:{port}" in errors[0] and "in use" in errors[0]


# -- a failed serving core in a real agent process (was tests/test_agent_core_failure.py) -------

CORE_FAILURE_NODE = "doomed"
CORE_FAILURE_TIMEOUT = 60.0
CORE_FAILURE_SCRIPT = Path(__file__).with_name("core_failure_agent.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until_present(store: EtcdStore, key: str) -> int:
    """Wait until ``key`` exists; returns the revision to watch its deletion from."""
    kv = await store.get(key)
    if kv is not None:
        return kv.mod_revision
    start = (await store.list(key)).revision + 1
    async for ev in store.watch(key, start):
        if ev.kv.key == key and ev.type == "PUT":
            return ev.kv.mod_revision
    raise AssertionError("watch ended")


async def _until_deleted(store: EtcdStore, key: str, start: int) -> None:
    async for ev in store.watch(key, start):
        if ev.kv.key == key and ev.type == "DELETE":
            return


async def test_failed_core_revokes_the_lease_and_exits_non_zero(
        etcd_server, store: EtcdStore, keys: Keys, test_model_dir: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(CORE_FAILURE_SCRIPT), "--node-name", CORE_FAILURE_NODE,
        "--etcd-endpoint", etcd_server.client_url, "--etcd-prefix", keys.root,
        "--listen", f"127.0.0.1:{_free_port()}", "--simulated-memory", "8Gi",
        "--lease-ttl", "30", "--source-policy", DEV_POLICY.to_json(),  # a temporary directory
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        node_key = keys.node(CORE_FAILURE_NODE)
        registered = await asyncio.wait_for(_until_present(store, node_key), CORE_FAILURE_TIMEOUT)
        deleted = asyncio.create_task(_until_deleted(store, node_key, registered + 1))
        a = Assignment(namespace="default", name="chat", generation=1, served_model_name="tiny",
                       source=ModelSource(uri=f"file://{test_model_dir}", revision="r1"),
                       memory_bytes=2**20)
        await store.put(keys.assignment(CORE_FAILURE_NODE, "default", "chat", "r1"), a.to_json())
        # the load kills the MLX thread; the agent leaves at once (a 30 s lease would keep a
        # crashed node's record for 30 s) and exits with its own status
        _, stderr = await asyncio.wait_for(proc.communicate(), CORE_FAILURE_TIMEOUT)
        await asyncio.wait_for(deleted, CORE_FAILURE_TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    err = stderr.decode()
    assert proc.returncode == EXIT_CORE_FAILED != 0, err
    assert await store.get(node_key) is None
    assert (await store.list(keys.root + "/reports/")).items == []
    critical = [line for line in err.splitlines() if "CRITICAL" in line]
    assert any("serving core failed (InjectedThreadDeath: injected: the MLX thread died while "
               "loading): stopping node agent doomed, revoking its lease" in line
               for line in critical), err
    assert "Traceback" not in err.split("stopping node agent")[-1], err


# -- API keys: a real agent over HTTPS (from tests/test_api_keys.py) ---------------------------


async def test_agent_over_https_serves_a_completion_with_a_key(
        etcd_server, store: EtcdStore, keys: Keys, test_model_dir: Path, tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", [])
    SECRETS.extend(pki.secrets())  # the server's private key must not be logged either
    key_file = write_keys(tmp_path / "keys", KEY_A)
    node = NodeAgent(AgentConfig(
        node_name="https", etcd_endpoint=etcd_server.client_url, etcd_prefix=keys.root,
        listen_port=0, lease_ttl=5, simulated_memory_bytes=64 * 2**30,
        api_key_file=str(key_file), metrics_auth="api-key",
        tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key),
        source_policy=DEV_POLICY))  # the model lies in a temporary directory
    try:
        await node.start()
        assert node.url and node.url.startswith("https://127.0.0.1:")
        a = Assignment(namespace="default", name="chat", generation=1, served_model_name="tiny",
                       source=ModelSource(uri=f"file://{test_model_dir}", revision="r1"),
                       memory_bytes=2**20, role=Role.STABLE)
        await store.put(keys.assignment("https", "default", "chat", "r1"), a.to_json())
        report_key = keys.report("https", "default", "chat", "r1")
        view = await watch_until(store, report_key, lambda v: report_key in v and (
            AssignmentReport.from_json(v[report_key]).state
            in (AssignmentState.READY, AssignmentState.FAILED)), timeout=120)
        assert AssignmentReport.from_json(view[report_key]).state == AssignmentState.READY

        trusting = ssl.create_default_context(cafile=str(pki.ca))
        client = openai.AsyncOpenAI(base_url=f"{node.url}/v1", api_key=KEY_A, max_retries=0,
                                    http_client=openai.DefaultAsyncHttpxClient(verify=trusting))
        r = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=3)
        assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
        await client.close()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{node.url}/health", ssl=trusting) as resp:
                assert resp.status == 200
            async with http.get(f"{node.url}/metrics", ssl=trusting) as resp:
                assert resp.status == 401, await body_of(resp)
            # plain HTTP on the TLS port gets no answer
            with pytest.raises(aiohttp.ClientError):
                async with http.get(node.url.replace("https://", "http://") + "/health") as r2:
                    await r2.read()
            # a client that does not trust the CA is refused in the handshake
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with http.get(f"{node.url}/health") as r3:
                    await r3.read()
    finally:
        await node.stop()


# -- API keys: a real agent process (from tests/test_api_keys.py) ------------------------------


async def test_real_agent_process_with_keys(etcd_server, keys: Keys, tmp_path: Path) -> None:
    """``python -m node_agent --api-key-file ... --forward-key-file ... --metrics-auth api-key``:
    /health open (start_agent waits on it), the API and /metrics keyed, rotation without a
    restart, a key file that goes away keeps the last keys (one error in the log)."""
    from mlx_fleet.devcluster.fleet import start_agent

    key_file = write_keys(tmp_path / "keys", KEY_A, KEY_B)
    fleet_file = write_keys(tmp_path / "fleet", KEY_FLEET)
    cp = types.SimpleNamespace(etcd_url=etcd_server.client_url, logs_dir=tmp_path / "logs",
                               extra=[], env=lambda: {})
    proc = await asyncio.to_thread(
        start_agent, cp, "keyed", etcd_prefix=keys.root,
        extra_args=("--api-key-file", str(key_file), "--forward-key-file", str(fleet_file),
                    "--metrics-auth", "api-key", "--log-level", "DEBUG"))
    try:
        async with aiohttp.ClientSession() as http:
            async def status(path: str, key: str | None = None) -> int:
                async with http.get(proc.url + path,
                                    headers=bearer(key) if key else {}) as resp:
                    await body_of(resp)
                    return resp.status

            assert await status("/health") == 200
            assert [await status("/v1/models", k) for k in (None, KEY_A, KEY_B, KEY_C,
                                                            KEY_FLEET)] == [401, 200, 200, 401, 200]
            assert [await status("/metrics", k) for k in (None, KEY_A)] == [401, 200]
            write_keys(key_file, KEY_C)
            assert [await status("/v1/models", k) for k in (KEY_A, KEY_C)] == [401, 200]
            key_file.unlink()
            assert [await status("/v1/models", k) for k in (KEY_A, KEY_C)] == [401, 200]
    finally:
        await asyncio.to_thread(proc.process.stop)
    log = proc.process.log_path.read_text(errors="replace")
    SEEN.append(log)
    assert "API keys required (2 in --api-key-file, 1 fleet-internal); /metrics needs a key" in log
    assert "re-read: 1 key(s) in force (2 before)" in log
    assert log.count("keeping the 1 key(s) read before") == 1


async def test_real_agent_process_without_keys_is_open_and_says_so(etcd_server, keys: Keys,
                                                                   tmp_path: Path) -> None:
    from mlx_fleet.devcluster.fleet import start_agent

    cp = types.SimpleNamespace(etcd_url=etcd_server.client_url, logs_dir=tmp_path / "logs",
                               extra=[], env=lambda: {})
    proc = await asyncio.to_thread(start_agent, cp, "open", etcd_prefix=keys.root)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(proc.url + "/v1/models") as resp:
                assert resp.status == 200
    finally:
        await asyncio.to_thread(proc.process.stop)
    log = proc.process.log_path.read_text(errors="replace")
    assert log.count("the API is OPEN: no --api-key-file") == 1


# -- last: nothing captured above contains a key --------------------------------------------------


def test_zz_no_key_in_anything_logged_or_answered() -> None:
    """tests/test_api_keys.py's scan, over what the tests here captured (its ``SEEN``)."""
    text = "\n".join(SEEN)
    # the scan has something to scan: the keyed agent process's log, with its rotations
    assert "re-read" in text and "keeping the" in text
    for secret in SECRETS:
        assert secret not in text
