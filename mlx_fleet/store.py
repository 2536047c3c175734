"""The project's narrow etcd interface, and its one implementation over ``aetcd``.

Everything else in mlx-fleet talks to etcd through :class:`Store` (get, list a prefix,
transaction, watch from a revision, leases), so the client library can be swapped without
touching the operator or the agent. ``aetcd`` (the asyncio fork of python-etcd3) is used because
python-etcd3 is abandoned, fails to import with protobuf >= 4 and blocks the event loop.

The interface itself (:class:`Store`, its records and errors) lives in :mod:`mlx_fleet.store_api`
and the watch discipline (:func:`follow_prefix`) in :mod:`mlx_fleet.views`, both without a
client; this module re-exports them under the names callers have always imported.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlparse

from mlx_fleet.etcd_credentials import EtcdCredentials
from mlx_fleet.etcd_security import Access, AuthPlan
from mlx_fleet.store_api import (  # re-exported: the interface's import path
    KV,
    Compacted,
    Compare,
    Delete,
    Listing,
    Put,
    Store,
    StoreError,
    WatchEvent,
)
from mlx_fleet.views import Snapshot, follow_prefix  # re-exported (they moved to views.py)

__all__ = ["KV", "Compacted", "Compare", "Delete", "Listing", "Put", "Store", "StoreError",
           "WatchEvent", "EtcdStore", "Snapshot", "follow_prefix", "parse_endpoint",
           "check_endpoint", "CLOSE_TIMEOUT_SECONDS", "RECONNECT_BACKOFF_MAX_SECONDS"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def _prefix_end(prefix: bytes) -> bytes:
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


def parse_endpoint(endpoint: str) -> tuple[str, int, bool]:
    """``http://host:port``, ``https://host:port`` (or ``host:port``, meaning http) →
    ``(host, port, tls)`` for a gRPC target; an IPv6 host keeps its brackets. Port defaults
    to 2379. Raises ``ValueError`` for another scheme or a missing host."""
    url = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    if url.scheme not in ("http", "https"):
        raise ValueError(f"unsupported etcd endpoint {endpoint!r}: use http://host:port or "
                         f"https://host:port")
    if not url.hostname:
        raise ValueError(f"etcd endpoint {endpoint!r} has no host")
    try:
        port = url.port or 2379
    except ValueError as e:
        raise ValueError(f"etcd endpoint {endpoint!r}: {e}") from e
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    return host, port, url.scheme == "https"


def check_endpoint(endpoint: str, credentials: EtcdCredentials | None) -> tuple[str, int, bool]:
    """:func:`parse_endpoint`, and the scheme must match the credentials: ``https`` needs a CA
    (``--etcd-ca-file``), TLS files with ``http`` are refused (no silent plaintext). Raises
    ``ValueError`` with one line naming the flag."""
    host, port, tls = parse_endpoint(endpoint)
    creds = credentials or EtcdCredentials()
    if tls and creds.ca_pem is None:
        raise ValueError(f"etcd endpoint {endpoint!r} is https: --etcd-ca-file is required")
    if creds.tls and not tls:
        raise ValueError(f"etcd endpoint {endpoint!r} is plain http but TLS files were "
                         f"given: use https://")
    return host, port, tls


RECONNECT_BACKOFF_MAX_SECONDS = 2.0
"""Longest pause between two attempts to reconnect to an etcd that is unreachable (gRPC channel
argument ``grpc.max_reconnect_backoff_ms``). gRPC's default is 120 s with a 1.6× back-off
(gRPC, doc/connection-backoff.md): after etcd had been down 30 s, the next attempt came about
11 s after it was back (measured by the fault suite, docs/reliability.md). Capped at 2 s, a
client reconnects within about 2 s of etcd's return, at the cost of one TCP connect every 2 s
while it is away."""


class EtcdStore:
    """:class:`Store` over an ``aetcd.Client``.

    ``endpoint``: ``http://host:port`` or ``https://host:port``; ``https`` needs
    ``credentials`` with at least a CA (:class:`~mlx_fleet.etcd_credentials.EtcdCredentials`),
    and TLS settings with an ``http`` endpoint are refused too (no silent plaintext).
    ``credentials``: CA, client certificate + key (mutual TLS; with etcd's
    ``--client-cert-auth`` the certificate's CN is the etcd user, no token involved) and/or
    user name + password (simple auth: a token sent with every call; when etcd answers that
    the token is invalid or expired — ``--auth-token-ttl``, default 300 s — the store
    re-authenticates once and retries the call).
    ``timeout``: per-RPC deadline in seconds for unary calls (watches have none).
    ``keepalive_seconds``: HTTP/2 ping interval while calls are open, so a half-open connection
    (a Mac that slept, a dropped NAT entry) breaks the watch stream within about
    ``keepalive_seconds + 5`` s instead of stalling it forever; :func:`follow_prefix` then
    resumes. It must stay above etcd's ``--grpc-keepalive-min-time`` (default 5 s) or etcd
    answers with GOAWAY ``too_many_pings``. An unreachable etcd is retried at most every
    :data:`RECONNECT_BACKOFF_MAX_SECONDS`.
    Raises ``ValueError`` for an endpoint/credentials mismatch, :class:`StoreError` (or
    :class:`Compacted`) instead of the client's exceptions. No error message carries the
    password, the token or key material.
    """

    def __init__(self, endpoint: str, *, credentials: EtcdCredentials | None = None,
                 timeout: float = 10.0, keepalive_seconds: float = 10.0) -> None:
        import aetcd  # imported here so the contract stays importable without grpc

        host, port, tls = check_endpoint(endpoint, credentials)
        creds = credentials or EtcdCredentials()
        self.endpoint = endpoint
        self._tls = tls
        self._aetcd = aetcd
        self._client = _client_class(aetcd)(
            creds if tls else None,
            host=host, port=port, timeout=timeout,
            username=creds.username, password=creds.password,
            options={"grpc.keepalive_time_ms": int(keepalive_seconds * 1000),
                     "grpc.keepalive_timeout_ms": 5000,
                     # etcd refuses pings on a connection without streams (PermitWithoutStream
                     # is false server-side), so ping only while a call is open.
                     "grpc.keepalive_permit_without_calls": 0,
                     "grpc.max_reconnect_backoff_ms": int(RECONNECT_BACKOFF_MAX_SECONDS * 1000)})
        self._reauth_lock = asyncio.Lock()

    async def __aenter__(self) -> EtcdStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        try:
            await self._client.connect()
        except self._aetcd.ClientError as e:
            raise StoreError(f"cannot connect to etcd at {self.endpoint}: {self._describe(e)}") from e

    async def close(self) -> None:
        """Close the client. aetcd's close first shuts its watcher down, which can wait forever
        on a watch stream that is already broken (its bounded request queue is never drained);
        after ``CLOSE_TIMEOUT_SECONDS`` the gRPC channel is closed directly instead."""
        if not await _bounded(self._client.close(), CLOSE_TIMEOUT_SECONDS):
            log.warning("etcd client for %s did not close in %.0f s; closing its channel",
                        self.endpoint, CLOSE_TIMEOUT_SECONDS)
            channel = getattr(self._client, "channel", None)
            if channel is not None:
                await channel.close()

    def _describe(self, e: BaseException) -> str:
        """:func:`_describe`, plus what to check when a TLS handshake failed (gRPC reports it
        as UNAVAILABLE with an SSL/TSI detail)."""
        text = _describe(e)
        if self._tls and isinstance(e, self._aetcd.exceptions.ConnectionFailedError) and any(
                m in text for m in ("TSI_", "SSL", "ssl", "handshake", "certificate")):
            text += (" (TLS handshake failed: check --etcd-ca-file against the server's CA and "
                     "that --etcd-cert-file/--etcd-key-file is a client certificate it trusts)")
        return text

    async def _reauthenticate(self, stale_metadata) -> None:
        """Fetch a fresh simple-auth token (once per expiry, however many calls saw it).

        The watcher's stream carries the token it was opened with, so it is replaced: live
        watches end with a :class:`StoreError` and :func:`follow_prefix` resumes them on a
        new stream that carries the new token."""
        async with self._reauth_lock:
            if self._client.metadata is not stale_metadata:
                return  # another call already re-authenticated
            log.info("etcd %s: auth token invalid or expired; re-authenticating as %r",
                     self.endpoint, self._client._username)
            try:
                await self._client.reauthenticate()
            except self._aetcd.ClientError as e:
                raise StoreError(f"etcd {self.endpoint}: re-authentication failed: "
                                 f"{self._describe(e)}") from e

    @staticmethod
    def _kv(kv) -> KV:  # aetcd KeyValue / protobuf KeyValue
        return KV(key=kv.key.decode(), value=bytes(kv.value), mod_revision=kv.mod_revision,
                  create_revision=kv.create_revision, version=kv.version, lease=kv.lease)

    async def _call(self, make: Callable[[], Awaitable]):
        """Run the client call ``make()``; on an invalid/expired auth token re-authenticate
        once and run it again. Maps the client's errors to :class:`StoreError`."""
        for attempt in (1, 2):
            metadata = self._client.metadata
            try:
                return await make()
            except self._aetcd.exceptions.RevisionCompactedError as e:
                raise Compacted(e.compacted_revision) from e
            except self._aetcd.exceptions.UnauthenticatedError as e:
                if attempt == 1 and self._client._username is not None and _token_problem(e):
                    await self._reauthenticate(metadata)
                    continue
                raise StoreError(f"etcd {self.endpoint}: {self._describe(e)}") from e
            except self._aetcd.ClientError as e:
                raise StoreError(f"etcd {self.endpoint}: {self._describe(e)}") from e
        raise AssertionError("unreachable")

    async def get(self, key: str) -> KV | None:
        res = await self._call(lambda: self._client.get(key.encode()))
        return None if res is None else self._kv(res)

    async def list(self, prefix: str) -> Listing:
        res = await self._call(lambda: self._client.get_prefix(prefix.encode()))
        return Listing(items=[self._kv(kv) for kv in res.kvs], revision=res.header.revision)

    def _op(self, op: Put | Delete):
        t = self._client.transactions
        if isinstance(op, Put):
            return t.put(op.key.encode(), op.value, lease=op.lease)
        return t.delete(op.key.encode())

    def _cmp(self, c: Compare):
        t = self._client.transactions
        field = {"mod": t.mod, "create": t.create, "version": t.version, "value": t.value}[c.target]
        lhs = field(c.key.encode())
        # aetcd's compare objects record the operator as a side effect of the comparison,
        # so exactly one operator may be applied to each.
        if c.op == "==":
            return lhs == c.value
        if c.op == "!=":
            return lhs != c.value
        if c.op == "<":
            return lhs < c.value
        return lhs > c.value

    async def txn(self, compares: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> int:
        """Apply ``success`` atomically if every compare holds (else ``failure``).

        Returns the store revision the transaction committed at when the compares held (≥ 1,
        so the result is truthy), 0 when they failed. The revision is read from the response
        of the first operation (etcd stamps each with the transaction's revision); with no
        operations it is the store revision read right after, which may be later."""
        ok, responses = await self._call(lambda: self._client.transaction(
            compare=[self._cmp(c) for c in compares],
            success=[self._op(o) for o in success],
            failure=[self._op(o) for o in failure],
        ))
        if not ok:
            return 0
        for r in responses:
            kind = r.WhichOneof("response")
            return int(getattr(r, kind).header.revision)
        return (await self.list("\0")).revision

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        """Unconditional put; returns the new store revision."""
        res = await self._call(lambda: self._client.put(key.encode(), value, lease=lease))
        return res.header.revision

    async def delete(self, key: str) -> bool:
        res = await self._call(lambda: self._client.delete(key.encode()))
        return res is not None and getattr(res, "deleted", 1) > 0

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Yield every change under ``prefix`` from ``start_revision`` (inclusive) on.

        Raises :class:`Compacted` if ``start_revision`` was compacted, :class:`StoreError` if
        the stream breaks. The caller resumes from ``last seen mod_revision + 1``.
        """
        key = prefix.encode()
        watch = await _abandonable(self._call(lambda: self._client.watch(
            key, range_end=_prefix_end(key), start_revision=start_revision)),
            on_late=lambda w: _bounded(w.cancel(), CLOSE_TIMEOUT_SECONDS))
        try:
            async for ev in watch:
                if not ev.kv.key.startswith(key):
                    # aetcd matches a "created" answer to the oldest pending create: under load
                    # a watch can end up bound to another watch's stream (seen in a test: an
                    # assignment delivered to a watch of reports/). Such a watch is broken —
                    # its own events may never come — so end it: the caller resumes from its
                    # last revision on a fresh watch (follow_prefix does).
                    raise StoreError(f"etcd watch {prefix}: received {ev.kv.key!r}, outside "
                                     f"the prefix (a misrouted watch); resuming")
                yield WatchEvent(type="PUT" if ev.kind == "PUT" else "DELETE",
                                 kv=KV(key=ev.kv.key.decode(), value=bytes(ev.kv.value),
                                       mod_revision=ev.kv.mod_revision,
                                       create_revision=ev.kv.create_revision,
                                       version=ev.kv.version, lease=ev.kv.lease))
        except self._aetcd.exceptions.RevisionCompactedError as e:
            raise Compacted(e.compacted_revision) from e
        except self._aetcd.ClientError as e:
            raise StoreError(f"etcd watch {prefix}: {self._describe(e)}") from e
        finally:
            # Cancelling takes aetcd's watcher lock and a slot in its bounded request queue;
            # on a broken stream neither may ever come, and an unbounded wait here hangs
            # whoever cancelled this watch (seen: a test's follower cancel hung for 10 min).
            if not await _bounded(watch.cancel(), CLOSE_TIMEOUT_SECONDS):
                log.warning("etcd watch %s: cancel not acknowledged in %.0f s; abandoned",
                            prefix, CLOSE_TIMEOUT_SECONDS)

    async def grant_lease(self, ttl_seconds: int) -> int:
        lease = await self._call(lambda: self._client.lease(ttl_seconds))
        return lease.id if hasattr(lease, "id") else lease.lease_id

    async def keepalive(self, lease_id: int) -> int:
        """Refresh the lease; returns its remaining TTL in seconds (0 or less: it expired)."""
        reply = await self._call(lambda: self._client.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    async def revoke_lease(self, lease_id: int) -> None:
        await self._call(lambda: self._client.revoke_lease(lease_id))

    async def time_to_live(self, lease_id: int) -> int:
        """Seconds left on the lease (etcd's ``LeaseTimeToLive``), -1 when it does not exist."""
        reply = await self._call(lambda: self._client.get_lease_info(lease_id, keys=False))
        return int(reply.TTL)

    async def compact(self, revision: int) -> None:
        """Compact etcd's history before ``revision`` (an admin operation: tests and
        maintenance). A watch from a lower revision then raises :class:`Compacted`. Raises
        :class:`StoreError` for a revision already compacted or a future one."""
        await self._call(lambda: self._client.compact(revision))

    # -- auth administration (mlx-fleet etcd bootstrap-auth) ------------------------------------

    async def _auth_rpc(self, method: str, request):
        """One call on etcd's Auth service with the current token, errors mapped like the rest."""
        async def call():
            await self._client.connect()
            try:
                return await getattr(self._client.auth_stub, method)(
                    request, timeout=self._client._timeout, metadata=self._client.metadata)
            except self._aetcd.rpc.AioRpcError as e:
                self._aetcd.exceptions._handle_exception(e)
        return await self._call(call)

    async def auth_enabled(self) -> bool:
        """Whether etcd's authentication is on (``AuthStatus``; any authenticated user may ask)."""
        return bool((await self._auth_rpc("AuthStatus", self._aetcd.rpc.AuthStatusRequest())).enabled)

    async def apply_auth_plan(self, plan: AuthPlan, passwords: Mapping[str, str],
                              *, enable: bool = True) -> list[str]:
        """Make etcd's users and roles match ``plan`` (idempotent) and, with ``enable``, turn
        authentication on. ``passwords``: user name → password for users that log in with one;
        the others get no password (``UserAddOptions.no_password``: client certificate only).
        An existing user's password is set again when given (rotation). Returns one line per
        change made (no secrets). Needs root rights once auth is on. Raises :class:`StoreError`.
        """
        rpc = self._aetcd.rpc
        done: list[str] = []
        for role in plan.roles:
            try:
                have = (await self._auth_rpc("RoleGet", rpc.AuthRoleGetRequest(role=role.name))).perm
            except StoreError as e:
                if "not found" not in str(e):
                    raise
                await self._auth_rpc("RoleAdd", rpc.AuthRoleAddRequest(name=role.name))
                done.append(f"role {role.name}: created")
                have = []
            want = {(p.key.encode(), _prefix_end(p.key.encode()) if p.prefix else b"",
                     int(p.access)) for p in role.permissions}
            current = {(bytes(p.key), bytes(p.range_end), int(p.permType)) for p in have}
            for key, end, access in sorted(current - want):
                await self._auth_rpc("RoleRevokePermission", rpc.AuthRoleRevokePermissionRequest(
                    role=role.name, key=key, range_end=end))
                done.append(f"role {role.name}: revoked {key.decode()!r}")
            for key, end, access in sorted(want - current):
                await self._auth_rpc("RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(
                    name=role.name, perm=rpc.Permission(permType=access, key=key, range_end=end)))
                done.append(f"role {role.name}: granted {Access(access).name} "
                            f"{key.decode()!r}{' (prefix)' if end else ''}")
        for user in plan.users:
            password = passwords.get(user.name)
            try:
                roles = list((await self._auth_rpc("UserGet", rpc.AuthUserGetRequest(
                    name=user.name))).roles)
            except StoreError as e:
                if "not found" not in str(e):
                    raise
                await self._auth_rpc("UserAdd", rpc.AuthUserAddRequest(
                    name=user.name, password=password or "",
                    options=rpc.UserAddOptions(no_password=password is None)))
                done.append(f"user {user.name}: created "
                            f"({'password' if password is not None else 'certificate only'})")
                roles = []
            else:
                if password is not None:
                    await self._auth_rpc("UserChangePassword", rpc.AuthUserChangePasswordRequest(
                        name=user.name, password=password))
                    done.append(f"user {user.name}: password set")
            for r in user.roles:
                if r not in roles:
                    await self._auth_rpc("UserGrantRole", rpc.AuthUserGrantRoleRequest(
                        user=user.name, role=r))
                    done.append(f"user {user.name}: granted role {r}")
        if enable and not await self.auth_enabled():
            await self._auth_rpc("AuthEnable", rpc.AuthEnableRequest())
            done.append("authentication enabled")
        return done


def _describe(e: BaseException) -> str:
    """``Type: detail`` of a client error, for messages (never carries request metadata)."""
    detail = str(e) or (str(e.__cause__) if e.__cause__ else "")
    return f"{type(e).__name__}: {detail}" if detail else type(e).__name__


def _token_problem(e: BaseException) -> bool:
    """True for etcd's answer to a stale simple-auth token (``etcdserver: invalid auth
    token``: expired after ``--auth-token-ttl`` idle seconds, dropped by a restart or a
    password change); not for a wrong password (``authentication failed``)."""
    return "auth token" in str(e).lower()


@functools.cache
def _client_class(aetcd) -> type:
    """``aetcd.Client`` extended with TLS and re-authentication (aetcd 1.x only opens
    ``grpc.aio.insecure_channel`` and authenticates once, in ``connect``).

    ``connect`` mirrors aetcd's: the channel is ``grpc.aio.secure_channel`` with
    ``grpc.ssl_channel_credentials(ca, key, cert)`` when TLS credentials are given, then the
    same stubs and watcher are set up. ``reauthenticate`` fetches a new token and replaces the
    watcher so the next watch opens a stream with the new token."""
    import grpc
    rpc = aetcd.rpc

    class _Watcher(aetcd.watcher.Watcher):
        """aetcd's watcher, plus: a watch etcd cancels (``canceled`` without a compaction,
        e.g. ``permission denied`` on create, or a later revocation) ends with that reason
        instead of waiting forever for events that never come."""

        async def _handle_response(self, response):
            if response.canceled and response.compact_revision == 0:
                reason = response.cancel_reason or "no reason given"
                # A watch created on a stream whose token expired is canceled with "invalid
                # auth token": raised as such, EtcdStore re-authenticates and retries.
                kind = (aetcd.exceptions.UnauthenticatedError if "auth token" in reason
                        else aetcd.ClientError)
                error = kind(f"watch canceled by etcd: {reason}")
                async with self._lock:
                    if response.created and self._new_callback is not None:
                        self._new_callback.error = error
                        self._new_callback_ready.notify_all()
                        return
                    callback = self._callbacks.pop(response.watch_id, None)
                if callback is not None:
                    await self._process_callback(callback, error)
                return
            await super()._handle_response(response)

    class _Client(aetcd.Client):
        def __init__(self, tls: EtcdCredentials | None, **kwargs) -> None:
            self._tls = tls
            super().__init__(**kwargs)

        def _open_channel(self):
            target = f"{self._host}:{self._port}"
            if self._tls is None:
                return rpc.insecure_channel(target, options=self._options.items())
            creds = grpc.ssl_channel_credentials(root_certificates=self._tls.ca_pem,
                                                 private_key=self._tls.key_pem,
                                                 certificate_chain=self._tls.cert_pem)
            return rpc.secure_channel(target, creds, options=self._options.items())

        async def _authenticate(self) -> None:
            resp = await self.auth_stub.Authenticate(
                rpc.AuthenticateRequest(name=self._username, password=self._password),
                timeout=self._timeout)
            self.metadata = (("token", resp.token),)

        @aetcd.client._handle_errors
        async def connect(self) -> None:
            if self._connected.is_set():
                return
            if self._is_connecting:
                await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
                return
            try:
                self._is_connecting = True
                self.channel = self._open_channel()
                self.auth_stub = rpc.AuthStub(self.channel)
                if self._username is not None:
                    await self._authenticate()
                self.kvstub = rpc.KVStub(self.channel)
                self.clusterstub = rpc.ClusterStub(self.channel)
                self.leasestub = rpc.LeaseStub(self.channel)
                self.maintenancestub = rpc.MaintenanceStub(self.channel)
                self._watcher = _Watcher(rpc.WatchStub(self.channel),
                                                      timeout=self._timeout, metadata=self.metadata)
                self._connected.set()
            except BaseException:
                if self.channel is not None:
                    await self.channel.close()
                self._init_channel_attrs()
                raise
            finally:
                self._is_connecting = False

        @aetcd.client._handle_errors
        async def reauthenticate(self) -> None:
            await self._authenticate()
            old = self._watcher
            self._watcher = _Watcher(rpc.WatchStub(self.channel),
                                                  timeout=self._timeout, metadata=self.metadata)
            if old is not None:  # its watches end with this error; the callers resume them
                await _bounded(old._terminate_stream(aetcd.ClientError(
                    "stream closed after re-authentication; resume the watch")),
                    CLOSE_TIMEOUT_SECONDS)

    return _Client


# ---------------------------------------------------------------------------------------------
# Bounded clean-up of aetcd's watches and client
# ---------------------------------------------------------------------------------------------


CLOSE_TIMEOUT_SECONDS = 5.0
"""Longest wait for a watch cancel or a client close before giving up on a clean goodbye."""


async def _bounded(aw: Awaitable, seconds: float) -> bool:
    """Run ``aw`` to completion in its own task, waiting at most ``seconds``; True if it
    finished (its errors are swallowed: this is for best-effort clean-up). On timeout the task
    is cancelled and False returned. The caller's own cancellation still propagates."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        return False
    if not task.cancelled():
        task.exception()  # retrieved: a failed clean-up is not an unhandled task error
    return True


async def _abandonable(aw: Awaitable[T], *, on_late: Callable[[T], Awaitable[Any]]) -> T:
    """``await aw``, run in a task of its own, so that cancelling the caller returns at once
    even when ``aw`` cannot finish cancelling. aetcd's watch creation waits on a condition of
    its watcher's lock, and a cancelled wait must take that lock again before it ends; a
    response handler stuck holding it (a full request queue on a broken stream) then hangs
    whoever cancelled — seen in CI as a test's follower cancel that never returned. On
    cancellation the task is left to finish (not cancelled: a cancel racing etcd's answer could
    leave a registered watch behind with no result to cancel it by); when it produces a
    result, ``on_late`` is run on it (cancel the watch nobody will read)."""
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def late(t: asyncio.Future) -> None:
            if not t.cancelled() and t.exception() is None:
                cleanup = asyncio.ensure_future(on_late(t.result()))
                _CLEANUPS.add(cleanup)  # (a reference, so it is not collected mid-way)
                cleanup.add_done_callback(_CLEANUPS.discard)

        task.add_done_callback(late)
        raise


#: Clean-ups of abandoned calls still running (:func:`_abandonable`).
_CLEANUPS: set[asyncio.Future] = set()
