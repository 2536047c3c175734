"""What only the etcd-backed store has: endpoint parsing (pure). aetcd's watch pitfalls, and a
parsed endpoint connecting, are tested on the real etcd in tests/test_integration_etcd.py.

The behaviour every Store shares (fencing, leases, watches, compaction, follow_prefix) is in
tests/test_store_contract.py, run on the real etcd and on the in-memory store."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("endpoint", "target"), [
    ("http://127.0.0.1:2379", ("127.0.0.1", 2379, False)),
    ("127.0.0.1:4001", ("127.0.0.1", 4001, False)),
    ("http://etcd.example", ("etcd.example", 2379, False)),
    ("http://[::1]:2379", ("[::1]", 2379, False)),
    ("https://etcd:2379", ("etcd", 2379, True)),
])
def test_parse_endpoint(endpoint: str, target: tuple[str, int, bool]) -> None:
    from mlx_fleet.store import parse_endpoint

    assert parse_endpoint(endpoint) == target


@pytest.mark.parametrize("endpoint", ["unix:///run/etcd.sock", "http://", "http://h:notaport"])
def test_parse_endpoint_refuses(endpoint: str) -> None:
    from mlx_fleet.store import parse_endpoint

    with pytest.raises(ValueError, match="etcd endpoint"):
        parse_endpoint(endpoint)
