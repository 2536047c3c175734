"""prometheus/promtool provisioning (mlx_fleet.devcluster.prombuild) and the Prometheus runner's
configuration (mlx_fleet.devcluster.promserver). Pure, but for the cached binaries' versions
(built once like the other binaries when missing)."""

from __future__ import annotations

import subprocess

import pytest

from mlx_fleet.devcluster.prombuild import PROMETHEUS_MODULE_VERSION, ensure_prometheus, release_version
from mlx_fleet.devcluster.promserver import (AGENT_JOB, OPERATOR_JOB, ROUTER_JOB, ScrapeTarget,
                                             scrape_config)


@pytest.mark.parametrize("module, release", [
    ("v0.307.3", "3.7.3"), ("v0.300.0", "3.0.0"), ("v0.316.1", "3.16.1"), ("v0.55.1", "0.55.1"),
])
def test_release_version(module: str, release: str) -> None:
    assert release_version(module) == release


def test_cached_binaries_report_the_pinned_release() -> None:
    bins = ensure_prometheus()
    for exe in (bins.prometheus, bins.promtool):
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert f"version {release_version(PROMETHEUS_MODULE_VERSION)} " in out.stdout + out.stderr


def test_scrape_config_labels_each_agent_with_its_node() -> None:
    cfg = scrape_config([ScrapeTarget("127.0.0.1:8080"), ScrapeTarget("127.0.0.1:9001", "mac-a"),
                         ScrapeTarget("127.0.0.1:9002", "mac-b")], interval="2s")
    assert cfg["global"]["scrape_interval"] == "2s"
    jobs = {j["job_name"]: j["static_configs"] for j in cfg["scrape_configs"]}
    assert jobs[OPERATOR_JOB] == [{"targets": ["127.0.0.1:8080"]}]
    assert jobs[AGENT_JOB] == [{"targets": ["127.0.0.1:9001"], "labels": {"node": "mac-a"}},
                               {"targets": ["127.0.0.1:9002"], "labels": {"node": "mac-b"}}]


def test_scrape_config_passes_promtool(tmp_path) -> None:
    import yaml

    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(scrape_config([ScrapeTarget("127.0.0.1:8080"),
                                                  ScrapeTarget("127.0.0.1:9001", "mac-a"),
                                                  ScrapeTarget("127.0.0.1:9100", router=True)])))
    res = subprocess.run([str(ensure_prometheus().promtool), "check", "config", str(path)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_scrape_config_puts_routers_in_their_own_job_without_a_node_label() -> None:
    cfg = scrape_config([ScrapeTarget("op:8080"), ScrapeTarget("r1:9100", router=True),
                         ScrapeTarget("r2:9100", router=True), ScrapeTarget("mac:8000", "mac")])
    jobs = {j["job_name"]: j["static_configs"] for j in cfg["scrape_configs"]}
    assert jobs == {OPERATOR_JOB: [{"targets": ["op:8080"]}],
                    AGENT_JOB: [{"targets": ["mac:8000"], "labels": {"node": "mac"}}],
                    ROUTER_JOB: [{"targets": ["r1:9100", "r2:9100"]}]}


def test_scrape_config_without_agents_has_only_the_operator_job() -> None:
    cfg = scrape_config([ScrapeTarget("op:8080")])
    assert [j["job_name"] for j in cfg["scrape_configs"]] == [OPERATOR_JOB]
