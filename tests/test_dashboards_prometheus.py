"""Every query of every dashboard panel returns data from a real Prometheus scraping a running
local fleet under load: kube-apiserver + etcd + the operator process + one agent process serving
a generated MLX model + a fleet router, a streamed load, and a Canary paused at 50 % (so both a
stable and a candidate revision serve, and the operator re-exports their statistics).

Through the router (API keys naming two tenants, one limited to 1 request per minute): streamed
requests to the deployment, two requests of the limited tenant (the second is rate-limited), and
one to a second ModelDeployment placed on a simulated Mac whose endpoint refuses connections
(the test plays its agent: a Ready report), so the router's attempts, retry decisions and
circuit breakers have series too.

Prometheus (built once from the Go module proxy, :mod:`mlx_fleet.devcluster.prombuild`) scrapes
the operator's ``/metrics``, the agent's and the router's, every second. The test waits for Prometheus' first
scrapes by polling its HTTP API (bounded), then polls every panel's query until each returns a
series with a finite value, for at most ``DATA_TIMEOUT`` seconds; the failure message lists the
queries that stayed empty. A panel naming a metric the code does not export never returns data,
so it fails here (and earlier, in tests/test_dashboards.py).

``MLX_FLEET_DASHBOARD_SAMPLE=<file>``: after the check, keep the load going
(``MLX_FLEET_DASHBOARD_SAMPLE_REQUESTS`` more requests, default 200), promote the canary, keep it
going again, then write every query's range result over the whole run to that JSON file
(scripts/render_dashboards.py draws docs/dashboards/*.png from it).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import aiohttp

from fleet_helpers import node_record, stub_manifest, until_assignments
from mlx_fleet.contract import AssignmentReport, AssignmentState, Keys
from mlx_fleet.dashboards import render_all
from mlx_fleet.dashboards.queries import expand, panel_queries
from mlx_fleet.devcluster.controlplane import ControlPlane
from mlx_fleet.devcluster.fleet import (AgentProcess, RouterProcess, start_agent, start_operator,
                                        start_router)
from mlx_fleet.devcluster.loadgen import LoadGenerator
from mlx_fleet.devcluster.processes import free_port
from mlx_fleet.store import EtcdStore
from mlx_fleet.devcluster.promserver import PrometheusServer, ScrapeTarget, start_prometheus
from test_canary_e2e import balanced_sessions, canary, deployment, wait_for

pytestmark = pytest.mark.integration

NODE = "mac-prom"
#: Scrape interval (s) and the rate window the queries get for Grafana's $__rate_interval (4
#: scrapes, as Grafana computes it: max(4 x scrape interval, interval + scrape interval)).
SCRAPE_SECONDS = 1
RATE_INTERVAL = "4s"
DATA_TIMEOUT = 30.0
#: The router's API keys: tenant "load" (no limit) and "tight" (1 request per minute).
LOAD_KEY, TIGHT_KEY = "load-key-0123456789", "tight-key-0123456789"
GHOST = "mac-ghost"  # a simulated Mac whose endpoint refuses connections


@pytest.fixture(scope="module")
def fleet(control_plane: ControlPlane, namespace: str, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[AgentProcess, PrometheusServer, RouterProcess, Keys]]:
    keys = Keys(f"/mlx-fleet-prom/{uuid.uuid4().hex[:8]}")
    key_file = tmp_path_factory.mktemp("router") / "api-keys"
    key_file.write_text(f"{LOAD_KEY} tenant=load\n{TIGHT_KEY} tenant=tight\n")
    metrics_port = free_port()
    op = start_operator(control_plane, etcd_prefix=keys.root, metrics_port=metrics_port,
                        extra_args=("--namespace", namespace))
    agent = start_agent(control_plane, NODE, etcd_prefix=keys.root, memory="64Gi", lease_ttl=3,
                        extra_args=("--stats-interval-seconds", "1"))  # a 1 s scrape's resolution
    router = start_router(control_plane, etcd_prefix=keys.root, namespaces=(namespace,),
                          # keyed, so /metrics would need a key by default: the scrape
                          # carries none, --metrics-auth open is the explicit choice
                          extra_args=("--api-key-file", str(key_file), "--metrics-auth", "open",
                                      "--tenant-limits", "tight:rpm=1"))
    prom = start_prometheus(tmp_path_factory.mktemp("prometheus"), [
        ScrapeTarget(f"127.0.0.1:{metrics_port}"),
        ScrapeTarget(agent.url.removeprefix("http://"), node=NODE),
        ScrapeTarget(router.url.removeprefix("http://"), router=True)],
        interval=f"{SCRAPE_SECONDS}s")
    # Scraping before anything is deployed: the reconciles and loads of the test are counted.
    prom.wait_for_scrapes(1, timeout=30)
    yield agent, prom, router, keys
    prom.stop()
    router.process.stop()
    for kind in ("canaries", "modeldeployments"):
        control_plane.kubectl("delete", kind, "--all", "-n", namespace, "--wait=true",
                              "--timeout=60s", check=False, timeout=70)
    agent.process.stop()
    op.stop()


async def _through_router(control_plane: ControlPlane, router: RouterProcess, keys: Keys,
                          namespace: str, model: str) -> None:
    """Traffic through the router for its panels (module docstring), beside the streamed load
    of tenant "load" the test keeps sending through it: two requests of tenant "tight" (the second refused: 429), and one to a deployment
    whose only replica is on a Mac refusing connections (a connection error, then the retry
    decision; no Mac is left to try)."""
    url = f"{router.url}/v1/chat/completions"

    async def chat(session: aiohttp.ClientSession, key: str, model: str, *, stream: bool,
                   sid: str) -> int:
        async with session.post(url, json={
                "model": model, "stream": stream, "max_tokens": 4,
                "messages": [{"role": "user", "content": f"hello {sid}"}]},
                headers={"Authorization": f"Bearer {key}", "X-Session-ID": sid}) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        assert [await chat(session, TIGHT_KEY, model, stream=False, sid="t")
                for _ in range(2)] == [200, 429]
        # A second deployment, placed on a simulated Mac (the test is its agent) that refuses
        # connections: its port was free and nothing listens there.
        dead = f"http://127.0.0.1:{free_port()}"
        async with EtcdStore(control_plane.etcd_url) as store:
            lease = await store.grant_lease(120)
            ghost = node_record(GHOST).model_copy(update={
                "address": dead, "labels": {"agent.mlx-fleet.io/test": "ghost"}})
            await store.put(keys.node(GHOST), ghost.to_json(), lease=lease)
            control_plane.kubectl("apply", "-f", "-", input=stub_manifest(
                "ghost", namespace, placement={"nodeSelector": {"agent.mlx-fleet.io/test": "ghost"}}))
            asg = (await until_assignments(store, keys, lambda v: GHOST in v))[GHOST]
            await store.put(keys.report(GHOST, namespace, "ghost", "v1"), AssignmentReport(
                node=GHOST, namespace=namespace, name="ghost", generation=asg.generation,
                revision="v1", state=AssignmentState.READY, reason="ModelLoaded",
                endpoint=dead).to_json(), lease=lease)
            # The router follows etcd on its own: wait (bounded) until it lists the model.
            deadline = time.monotonic() + 30
            while True:
                async with session.get(f"{router.url}/v1/models",
                                       headers={"Authorization": f"Bearer {LOAD_KEY}"}) as r:
                    listed = {m["id"] for m in (await r.json())["data"]}
                if "ghost" in listed:
                    break
                assert time.monotonic() < deadline, f"the router never listed ghost: {listed}"
                await asyncio.sleep(0.2)
            assert await chat(session, LOAD_KEY, "ghost", stream=False, sid="g") in (502, 503)


def _has_data(result: list[dict]) -> bool:
    return any(not math.isnan(float(v)) for series in result for _, v in series["values"])


async def test_every_panel_query_returns_data(control_plane: ControlPlane, namespace: str,
                                              fleet: tuple[AgentProcess, PrometheusServer,
                                                           RouterProcess, Keys],
                                              test_model_dir: Path) -> None:
    agent, prom, router, keys = fleet
    start = time.time()
    name, can = "dash", "dash-v2"
    control_plane.kubectl("apply", "-f", "-", input=deployment(name, namespace, test_model_dir,
                                                               "v1").replace('"replicas": 2',
                                                                             '"replicas": 1'))
    md = await asyncio.to_thread(wait_for, control_plane, "modeldeployment", namespace, name,
                                 "condition=Ready")
    endpoints = list(md["status"]["endpoints"])
    queries = [(dash, q) for dash, text in render_all().items()
               for q in panel_queries(json.loads(text))]
    variables = {"namespace": namespace, "deployment": name, "node": NODE}
    # the same kind of load through the router (its histograms need requests across scrapes)
    async with LoadGenerator(lambda: endpoints, name,
                             sessions=balanced_sessions(namespace, name, each=2)) as load, \
            LoadGenerator(lambda: [router.url], name, sessions=["routed-0", "routed-1"],
                          headers={"Authorization": f"Bearer {LOAD_KEY}"}) as routed:
        await load.wait_for(4)
        control_plane.kubectl("apply", "-f", "-", input=canary(
            can, namespace, name, "v2", None, [{"setWeight": 50}, {"pause": {}}]))
        await asyncio.to_thread(wait_for, control_plane, "canary", namespace, can,
                                "jsonpath={.status.phase}=Paused", 60)
        await _through_router(control_plane, router, keys, namespace, name)
        await routed.wait_for(4)
        await asyncio.to_thread(prom.wait_for_scrapes, 2, timeout=30)
        # Poll Prometheus until every query has data (rates need two scrapes of a counter that
        # moved; the agents write canary statistics once per analysis interval), bounded.
        deadline = time.monotonic() + DATA_TIMEOUT
        while True:
            end = time.time()
            window = f"{math.ceil(end - start) + 1}s"
            results = {}
            for dash, q in queries:
                expr = expand(q.expr, variables, rate_interval=RATE_INTERVAL, time_range=window)
                results[(dash, q.panel, q.legend, expr)] = await asyncio.to_thread(
                    prom.query_range, expr, start, end, SCRAPE_SECONDS)
            empty = [k for k, r in results.items() if not _has_data(r)]
            if not empty or time.monotonic() > deadline:
                break
            await asyncio.to_thread(prom.wait_for_next_scrape, timeout=10)
        sample = os.environ.get("MLX_FLEET_DASHBOARD_SAMPLE")
        if sample and not empty:
            # Recording for docs/dashboards/*.png: more traffic, then the canary promoted past
            # its pause (weight 50 -> 100, Promoting -> Succeeded), then more traffic.
            extra = int(os.environ.get("MLX_FLEET_DASHBOARD_SAMPLE_REQUESTS", "200"))
            await load.wait_for(len(load.outcomes) + extra)
            promote = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mlx_fleet.cli", "canary", "promote", can, "-n", namespace,
                env={**os.environ, **control_plane.env()})
            await promote.wait()
            await load.wait_for(len(load.outcomes) + extra)
    assert not [o for o in load.outcomes + routed.outcomes if o.failed][:3]
    assert not empty, "panel queries without data:\n" + "\n".join(
        f"  {d} / {p}: {e}" for d, p, _, e in empty)
    if sample:
        await asyncio.to_thread(prom.wait_for_next_scrape, timeout=10)
        end = time.time()
        window = f"{math.ceil(end - start) + 1}s"
        records = []
        for dash, q in queries:
            expr = expand(q.expr, variables, rate_interval=RATE_INTERVAL, time_range=window)
            records.append({"dashboard": dash, "panel": q.panel, "legend": q.legend,
                            "template": q.expr, "expr": expr, "result": await asyncio.to_thread(
                                prom.query_range, expr, start, end, SCRAPE_SECONDS)})
        Path(sample).write_text(json.dumps({
            "start": start, "end": end, "step": SCRAPE_SECONDS, "variables": variables,
            "queries": records}, separators=(",", ":")) + "\n")
