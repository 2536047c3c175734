"""Run a real Prometheus on loopback that scrapes a local fleet: the operator's ``/metrics``,
the fleet routers' and, directly, the agents' (each agent's series labelled
``node=<its node name>``, as the Mac dashboard expects).

Used by the dashboards' end-to-end test (every panel query must return data), the PNG renderer
and ``mlx-fleet dev up --prometheus``. The binary comes from :mod:`.prombuild` (built once from
the Go module proxy). Readiness and the first scrape are waited for by polling Prometheus' HTTP
API, bounded by a timeout.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from mlx_fleet.devcluster.processes import ManagedProcess, ProcessFailed, free_port
from mlx_fleet.devcluster.prombuild import PrometheusBinaries, ensure_prometheus

__all__ = ["ScrapeTarget", "PrometheusServer", "scrape_config", "start_prometheus",
           "OPERATOR_JOB", "AGENT_JOB", "ROUTER_JOB"]

#: Job names of the three kinds of targets.
OPERATOR_JOB = "mlx-fleet-operator"
AGENT_JOB = "mlx-fleet-agent"
ROUTER_JOB = "mlx-fleet-router"


@dataclasses.dataclass(frozen=True)
class ScrapeTarget:
    """One ``/metrics`` endpoint: ``address`` is ``host:port``; ``node`` names the Mac of an
    agent (``None`` for the operator and routers); ``router``: a fleet router's (its series
    already carry their Mac in their own ``node`` label, so the target gets none)."""

    address: str
    node: str | None = None
    router: bool = False


def scrape_config(targets: list[ScrapeTarget], *, interval: str = "15s") -> dict[str, Any]:
    """A Prometheus configuration (as a dict, for YAML) scraping ``targets`` every ``interval``
    (a Prometheus duration): the operator targets in job :data:`OPERATOR_JOB`, the agents in
    :data:`AGENT_JOB` with a ``node`` label each, the fleet routers in :data:`ROUTER_JOB`.
    Pure."""
    operators = [t.address for t in targets if t.node is None and not t.router]
    routers = [t.address for t in targets if t.router]
    agents = [t for t in targets if t.node is not None and not t.router]
    jobs: list[dict[str, Any]] = []
    if operators:
        jobs.append({"job_name": OPERATOR_JOB, "static_configs": [{"targets": operators}]})
    if agents:
        jobs.append({"job_name": AGENT_JOB, "static_configs": [
            {"targets": [t.address], "labels": {"node": t.node}} for t in agents]})
    if routers:
        jobs.append({"job_name": ROUTER_JOB, "static_configs": [{"targets": routers}]})
    return {"global": {"scrape_interval": interval, "scrape_timeout": interval,
                       "evaluation_interval": interval},
            "scrape_configs": jobs}


class PrometheusError(RuntimeError):
    """Prometheus answered an API call with an error (the message has its ``error``)."""


@dataclasses.dataclass
class PrometheusServer:
    """A running Prometheus: ``url`` (``http://127.0.0.1:<port>``) and its process."""

    url: str
    process: ManagedProcess
    config_path: Path

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>?params`` → the ``data`` of the answer. Raises
        :class:`PrometheusError` when the status is not ``success``, ``OSError`` when
        unreachable."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400/422 carry a JSON error
            body = json.load(e)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query → the vector's samples (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [data]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """Range query → ``[{"metric": {...}, "values": [[t, "v"], ...]}]``."""
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                        step=f"{step:g}")["result"]

    def wait_for_scrapes(self, n: int = 1, *, timeout: float = 30.0) -> None:
        """Return once every target has been scraped successfully at least ``n`` times since
        start (``n`` samples of ``up`` and the last one 1), polling the API. Raises
        :class:`ProcessFailed` after ``timeout`` seconds, naming the targets still down."""
        def scraped() -> bool:
            expected = len(self.api("targets", state="active")["activeTargets"])
            ok = self.query(f"count_over_time(up[1h]) >= {n} and on (job, instance) up == 1")
            return expected > 0 and len(ok) >= expected

        try:
            self.process.wait_until(scraped, timeout=timeout, what=f"scraped {n}x", interval=0.2)
        except ProcessFailed as e:
            health = [(t["scrapeUrl"], t["health"], t.get("lastError"))
                      for t in self.api("targets", state="active")["activeTargets"]]
            raise ProcessFailed(f"{e}\ntargets: {health}") from None

    def wait_for_next_scrape(self, *, timeout: float = 30.0) -> None:
        """Return once every active target has been scraped again (its ``lastScrape`` moved
        on), polling the API. Raises :class:`ProcessFailed` after ``timeout`` seconds."""
        def last() -> dict[str, str]:
            return {t["scrapeUrl"]: t["lastScrape"]
                    for t in self.api("targets", state="active")["activeTargets"]}

        before = last()
        self.process.wait_until(
            lambda: bool(before) and all(now != before.get(url) for url, now in last().items()),
            timeout=timeout, what="scraped again", interval=0.2)

    def stop(self) -> None:
        self.process.stop()


def start_prometheus(workdir: Path, targets: list[ScrapeTarget], *, interval: str = "15s",
                     port: int | None = None, binaries: PrometheusBinaries | None = None,
                     timeout: float = 60.0) -> PrometheusServer:
    """Start Prometheus on ``127.0.0.1:port`` (default: a free port) with its TSDB, config and
    log under ``workdir``, scraping ``targets`` every ``interval``; returns once ``/-/ready``
    answers. Raises :class:`ProcessFailed` (naming the log) if it exits or is not ready within
    ``timeout`` seconds."""
    binaries = binaries or ensure_prometheus()
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(targets, interval=interval), sort_keys=False))
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    proc = ManagedProcess("prometheus", [
        binaries.prometheus, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1d",
        "--log.level=warn",
    ], workdir / "prometheus.log", cwd=workdir)

    def ready() -> bool:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
            return r.status == 200

    try:
        proc.wait_until(ready, timeout=timeout, what="ready (/-/ready)")
    except ProcessFailed:
        proc.stop()
        raise
    return PrometheusServer(url=url, process=proc, config_path=config)
