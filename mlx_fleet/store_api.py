"""The project's narrow etcd interface: the :class:`Store` protocol and its records.

No client here (no aetcd, no gRPC), so pure code, :mod:`mlx_fleet.memstore` and typed views
can depend on the interface without the transport. :mod:`mlx_fleet.store` implements it over
etcd and re-exports these names (the import path callers have always used).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Literal, Protocol


@dataclasses.dataclass(frozen=True)
class KV:
    """One key-value pair with etcd's revision metadata (``mod_revision``, ``create_revision``:
    cluster revisions; ``version``: number of writes since creation; ``lease``: lease ID or 0)."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int = 0
    version: int = 0
    lease: int = 0


@dataclasses.dataclass(frozen=True)
class Listing:
    """The result of a prefix read: items sorted by key and the store ``revision`` it was read at."""

    items: list[KV]
    revision: int


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    """A change to one key. For ``DELETE`` the ``kv.value`` is empty and ``kv.mod_revision`` is
    the revision of the deletion."""

    type: Literal["PUT", "DELETE"]
    kv: KV


@dataclasses.dataclass(frozen=True)
class Compare:
    """A transaction guard: ``target`` of ``key`` compared to ``value`` with ``op``.

    ``target``: ``"mod"`` (mod_revision), ``"create"`` (create_revision), ``"version"`` or
    ``"value"``. A key that does not exist has mod_revision, create_revision and version 0,
    so ``Compare(key, "mod", "==", 0)`` means "key absent".
    """

    key: str
    target: Literal["mod", "create", "version", "value"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes


@dataclasses.dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int | None = None


@dataclasses.dataclass(frozen=True)
class Delete:
    key: str


class StoreError(Exception):
    """etcd could not be reached or refused the request (wraps the client's error)."""


class Compacted(StoreError):
    """The requested watch start revision was compacted; re-list from the present."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted below {compact_revision}")
        self.compact_revision = compact_revision


class Store(Protocol):
    """What mlx-fleet needs from etcd. All methods are coroutines safe to call concurrently."""

    async def get(self, key: str) -> KV | None: ...

    async def list(self, prefix: str) -> Listing: ...

    async def txn(self, compares: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> int: ...

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int: ...

    async def delete(self, key: str) -> bool: ...

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]: ...

    async def grant_lease(self, ttl_seconds: int) -> int: ...

    async def keepalive(self, lease_id: int) -> int: ...

    async def revoke_lease(self, lease_id: int) -> None: ...

    async def close(self) -> None: ...
