"""The fleet router's command line (mlx_fleet_router.main): --help, flags → settings, refusals
before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlx_fleet_router import breaker, limits, retry
from mlx_fleet_router.main import configure, main, parse_args, settings_from_args


def test_help_explains_the_api() -> None:
    out = subprocess.run([sys.executable, "-m", "mlx_fleet_router", "--help"], check=True,
                         capture_output=True, text=True).stdout
    for what in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                 "/metrics", "--namespace", "--api-key-file", "--forward-key-file",
                 "--tenant-limits", "--etcd-ca-file"):
        assert what in out


def test_default_settings_are_the_decision_modules() -> None:
    s = settings_from_args(parse_args([]))
    assert s.breaker == breaker.BreakerConfig()
    assert s.retry == retry.RetryConfig()
    assert s.queue == limits.QueueConfig()
    assert s.tenant_limits == {}


def test_flags_to_settings() -> None:
    s = settings_from_args(parse_args([
        "--tenant-limits", "acme:rpm=60,tpm=1000", "--tenant-limits", "b:concurrent=2",
        "--max-attempts", "2", "--breaker-cooldown", "5", "--max-queued", "3",
        "--max-queue-wait", "1.5", "--probe-interval", "0"]))
    assert s.tenant_limits == {
        "acme": limits.TenantLimits(requests_per_minute=60, tokens_per_minute=1000),
        "b": limits.TenantLimits(max_concurrent=2)}
    assert s.retry.max_attempts == 2 and s.breaker.cooldown_seconds == 5
    assert s.queue == limits.QueueConfig(max_queued=3, max_wait_seconds=1.5)
    assert s.probe_interval_seconds == 0


@pytest.mark.parametrize("flag", ["acme", "acme:rpm=x", "acme:rph=1", "acme:rpm=0"])
def test_bad_tenant_limits_are_refused(flag: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--tenant-limits", flag])


def test_unusable_files_are_refused_before_start(tmp_path: Path, capsys) -> None:
    assert main(["--api-key-file", str(tmp_path / "missing")]) == 2
    assert "--api-key-file" in capsys.readouterr().err
    (tmp_path / "keys").write_text("sk-0123456789abcdef tenant=acme\n")
    setup = configure(parse_args(["--api-key-file", str(tmp_path / "keys")]))
    assert setup.api_keys is not None and setup.api_keys.tenant_of("sk-0123456789abcdef") == "acme"
    assert main(["--etcd-endpoint", "https://127.0.0.1:2379"]) == 2  # https needs a CA
