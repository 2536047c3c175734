"""Table tests of the connection admission decisions (mlx_fleet.connection_limits, issue 19)."""

from __future__ import annotations

import pytest

from mlx_fleet.connection_limits import (FD_HEADROOM, TOO_MANY, TOO_MANY_FROM_CLIENT, admit,
                                         client_key, fd_limit_plan, keep_alive)


@pytest.mark.parametrize("host, key", [
    ("192.0.2.7", "192.0.2.7"),
    ("127.0.0.1", "127.0.0.1"),  # loopback is a client like any other
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),  # the same /64: one client
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("fe80::1%eth0", "fe80::/64"),
    ("::ffff:192.0.2.7", "192.0.2.7"),  # IPv4-mapped: the IPv4 client
    ("::1", "::/64"),
    (None, ""), ("", ""),  # no IP address (a Unix socket)
])
def test_client_key(host: str | None, key: str) -> None:
    assert client_key(host) == key


@pytest.mark.parametrize("total, mine, verdict", [
    (0, 0, None),
    (7, 3, None),
    (8, 0, TOO_MANY),  # the global cap first
    (8, 4, TOO_MANY),
    (5, 4, TOO_MANY_FROM_CLIENT),
    (4, 5, TOO_MANY_FROM_CLIENT),
])
def test_admit(total: int, mine: int, verdict: str | None) -> None:
    assert admit(total, mine, max_connections=8, max_per_client=4) == verdict


@pytest.mark.parametrize("requests, age, alive", [
    (1, 0.0, True), (999, 3599.0, True),
    (1000, 0.0, False),  # keepalive_requests reached
    (1, 3600.0, False),  # keepalive_time reached
])
def test_keep_alive(requests: int, age: float, alive: bool) -> None:
    assert keep_alive(requests, age, max_requests=1000, max_age_seconds=3600.0) is alive


NEED = 512 + FD_HEADROOM


@pytest.mark.parametrize("soft, hard, new_soft, warns", [
    (NEED, NEED, None, False),  # enough
    (-1, -1, None, False),  # unlimited
    (256, -1, NEED, False),  # launchd's default soft limit, hard unlimited: raised
    (256, 10240, NEED, False),
    (256, 400, 400, True),  # raised to the hard limit, still short
    (256, 256, None, True),  # nothing to raise
])
def test_fd_limit_plan(soft: int, hard: int, new_soft: int | None, warns: bool) -> None:
    got_soft, warning = fd_limit_plan(512, soft, hard)
    assert got_soft == new_soft
    assert (warning is not None) is warns
    if warning:
        assert "--max-connections 512" in warning and "NumberOfFiles" in warning
