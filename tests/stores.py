"""Marks that run a test on the real etcd as well as (or instead of) the in-memory store.

A module whose logic needs a store, not etcd, overrides ``store`` with the conftest fixture
``memory_or_etcd_store`` (the in-memory store by default); these marks parametrize that fixture
for the few tests that are about the process against a real etcd (marked integration).
"""

from __future__ import annotations

import pytest

#: The test runs on the real etcd and on the in-memory store.
ON_BOTH = pytest.mark.parametrize("memory_or_etcd_store", [
    pytest.param("etcd", marks=pytest.mark.integration), "memory"], indirect=True)
#: The test runs on the real etcd only.
ON_ETCD = pytest.mark.parametrize("memory_or_etcd_store", [
    pytest.param("etcd", marks=pytest.mark.integration)], indirect=True)
