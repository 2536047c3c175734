"""kopf handlers for ``modeldeployments.mlx-fleet.io/v1alpha1`` (and the operator's start-up,
probes and MacNode events): the thin kopf layer. Each handler finds the operator's
:class:`~.runtime.Runtime` in kopf's ``memo`` and hands over to the module that does the job.

* ``on.startup``: kopf settings, the etcd store, the :class:`~.runtime.Runtime` (into
  ``memo.runtime``), the etcd followers (:mod:`.followers`), the background loops — orphan
  collection (:mod:`.orphan_gc`), the MacNode mirror (:mod:`.macnode_mirror`), with
  ``--peering`` the peering watch (:mod:`.peering_watch`) — each supervised (:mod:`mlx_fleet.supervise`: logged,
  restarted with backoff, liveness fails while one is down), the metrics collector and server.
* ``on.create`` / ``on.update`` / ``on.resume``: :func:`.sync.sync` — parse the spec,
  reconcile, compute and queue ``status`` (:mod:`.status_writer`), post events.
* ``daemon`` (one per ModelDeployment): waits on the deployment's wake-up (set by the
  followers, by a spec change, by a Canary, or soon after a reconcile gave up on etcd
  conflicts) or a periodic resync (:data:`RESYNC_SECONDS`) and runs :func:`.sync.sync` again,
  so node churn re-places replicas and agents' reports reach ``status``.
* ``on.event`` of MacNodes: a changed cordon or drain wakes the mirror at once.
* ``on.delete``: removes the deployment's assignments (fenced), forgets its record
  (:meth:`.runtime.Runtime.forget`), then kopf drops the finalizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from mlx_fleet.contract import Keys
from mlx_fleet.store import EtcdStore, StoreError
from mlx_fleet.supervise import dead, wait_event

from . import macnode_mirror, metrics, orphan_gc, peering_watch
from .canary_handlers import seed_candidates
from .config import OperatorConfig
from .kube import FINALIZER, GROUP, MACNODE_PLURAL, PLURAL, VERSION, kubernetes_api
from .reconcile import ConflictError, remove_deployment
from .runtime import Runtime, runtime
from .sync import sync

#: Seconds between unconditional re-syncs of a deployment (a safety net under the watches).
RESYNC_SECONDS = 30.0

log = logging.getLogger(__name__)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, logger: logging.Logger, memo: kopf.Memo,
                  **_: Any) -> None:
    """Configure kopf, connect etcd, start the followers and background loops; the
    :class:`Runtime` goes into ``memo.runtime``. The configuration is ``memo.config`` (set by
    :func:`~.main.main` through ``kopf.run(memo=...)``), else read from the environment
    (``kopf run``)."""
    cfg = memo.get("config") or OperatorConfig.from_env()
    # Watches: ask the server to end each watch after 60 s and give up on a silent connection
    # after 90 s, so a half-dead connection never freezes the operator (kopf's default: none).
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.watching.connect_timeout = 10
    settings.networking.connect_timeout = 10
    settings.networking.request_timeout = 60
    # Only warnings and errors of handler logs become Kubernetes events; our own transitions
    # are posted explicitly with kopf.event().
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = FINALIZER
    # Progress and diff-base in annotations: the CRD's status schema prunes unknown fields,
    # so kopf's default status.kopf storage would be silently dropped.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="mlx-fleet.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="mlx-fleet.io", key="last-handled-configuration")

    # A failure here is permanent: kopf would otherwise retry this handler every 60 s forever
    # (the process never exits). Whatever was started is stopped first, so nothing leaks.
    store = EtcdStore(cfg.etcd_endpoint, credentials=cfg.etcd_credentials)
    rt: Runtime | None = None
    try:
        await store.connect()
        api = await asyncio.to_thread(kubernetes_api)
        rt = Runtime(store, Keys(cfg.etcd_prefix), cfg.writer, in_scope=cfg.in_scope,
                     gc_interval=cfg.gc_interval, custom_api=api, router_url=cfg.router_url,
                     source_policy=cfg.source_policy,
                     list_live=lambda: orphan_gc.list_live_deployments(api, cfg.namespaces))
        # Running Canaries' candidates, before any ModelDeployment resumes: a restart
        # mid-canary must never unload a warm candidate.
        try:
            rt.seed_candidates(await asyncio.to_thread(seed_candidates, api, cfg.namespaces))
        except Exception as e:  # e.g. the Canary CRD is not installed: no canaries to keep
            logger.warning("cannot list Canaries at start-up (%s: %s); none resumed",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        rt.start_followers()
        orphan_gc.start(rt)
        macnode_mirror.start(rt)
        if cfg.peering is not None:
            peering_watch.start(rt, api, cfg.peering, cfg.namespaces)
        try:  # resume handlers should see the agents' reports; don't hang if etcd is slow
            await asyncio.wait_for(asyncio.gather(rt.views.node_view.synced.wait(),
                                                  rt.views.report_view.synced.wait()), timeout=30)
        except asyncio.TimeoutError:
            logger.warning("etcd views not loaded after 30s; continuing, watches will catch up")
        metrics.register_fleet(lambda: memo.get("runtime"))  # fleet state, at scrape time
        if not cfg.metrics_served:
            metrics.serve(cfg.metrics_port)
    except BaseException as e:  # also on cancellation (SIGTERM during start-up)
        with contextlib.suppress(Exception):
            if rt is not None:
                await rt.close()  # stops the followers, closes the store
            else:
                await store.close()
        if not isinstance(e, Exception):
            raise
        raise kopf.PermanentError(f"start-up failed: {type(e).__name__}: {e}") from e
    memo.runtime = rt
    logger.info("mlx-fleet operator started: etcd %s, prefix %s, metrics port %s, source "
                "policy %s", cfg.etcd_endpoint, cfg.etcd_prefix, cfg.metrics_port or "off",
                cfg.source_policy.to_json())


@kopf.on.cleanup()
async def cleanup(logger: logging.Logger, memo: kopf.Memo, **_: Any) -> None:
    rt = memo.pop("runtime", None)
    if rt is not None:
        await rt.close()
    logger.info("mlx-fleet operator stopped")


@kopf.on.probe(id="etcd_nodes")
async def probe_nodes(memo: kopf.Memo, **_: Any) -> int:
    """Liveness probe payload: the number of node records seen in etcd."""
    return len(runtime(memo).nodes)


@kopf.on.probe(id="etcd_followers")
async def probe_followers(memo: kopf.Memo, **_: Any) -> dict[str, int]:
    """Liveness: follower → restarts so far. Raises (the liveness endpoint then answers 500)
    while a follower is dead and backing off; a permanent error so kopf does not retry it."""
    rt = runtime(memo)
    down = dead(rt.followers.values())
    if down:
        raise kopf.PermanentError("etcd follower(s) down: " + "; ".join(
            f"{h.name} ({h.last_error}, {h.restarts} restarts)" for h in down))
    return {name: h.restarts for name, h in rt.followers.items()}


@kopf.on.event(GROUP, VERSION, MACNODE_PLURAL)
async def macnode_event(name: str, spec: Mapping[str, Any], labels: Mapping[str, str],
                       memo: kopf.Memo, **_: Any) -> None:
    """A MacNode changed: when its cordon, drain or labels are not what the operator applies,
    wake the mirror at once (``mlx-fleet drain`` or ``kubectl label macnode`` should not wait
    for the next round). A silent watch: kopf stores nothing on the object for event
    handlers."""
    rt = memo.get("runtime")
    if isinstance(rt, Runtime) and (macnode_mirror.spec_differs(rt, name, spec)
                                    or dict(labels or {}) != rt.node_labels.get(name)):
        rt.macnodes_changed()


_RESOURCE = dict(group=GROUP, version=VERSION, plural=PLURAL)


@kopf.on.resume(**_RESOURCE)
@kopf.on.create(**_RESOURCE)
@kopf.on.update(**_RESOURCE)
async def reconcile_handler(body: kopf.Body, logger: logging.Logger, namespace: str, name: str,
                            memo: kopf.Memo, **_: Any) -> None:
    """A new, changed or (at start-up) resumed ModelDeployment: sync it now. Raises what
    :func:`.sync.sync` raises (kopf retries a temporary error, stops on a permanent one)."""
    rt = runtime(memo)
    await sync(rt, body, logger)  # an invalid spec: sync() posted the InvalidSpec event already
    rt.deployment((namespace, name))  # make sure the daemon's record exists


@kopf.daemon(**_RESOURCE, cancellation_timeout=10.0)
async def follow_deployment(stopped: kopf.DaemonStopped, body: kopf.Body, logger: logging.Logger,
                            namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Re-sync on etcd changes (node churn, agent reports) and every RESYNC_SECONDS."""
    rt = runtime(memo)
    key = (namespace, name)
    wake = rt.deployment(key).wake

    async def relay_stop() -> None:
        await stopped.wait()
        wake.set()

    relay = asyncio.create_task(relay_stop())
    try:
        while not stopped:
            await wait_event(wake, RESYNC_SECONDS)
            wake.clear()
            if stopped:
                break
            try:
                await sync(rt, body, logger)
            except (kopf.PermanentError, kopf.TemporaryError) as e:
                logger.debug("re-sync of %s/%s deferred: %s", namespace, name, e)
            except Exception:  # keep following; the next wake-up or resync retries
                logger.exception("re-sync of %s/%s failed", namespace, name)
                await asyncio.sleep(1)
    finally:
        relay.cancel()


@kopf.on.delete(**_RESOURCE)
async def delete_handler(namespace: str, name: str, logger: logging.Logger, memo: kopf.Memo,
                         **_: Any) -> None:
    """Remove the deployment's assignments (one fenced transaction, under its lock), then
    forget everything kept about it; kopf drops the finalizer when this returns. Raises
    ``kopf.TemporaryError`` on etcd conflicts or outages (kopf retries)."""
    rt = runtime(memo)
    key = (namespace, name)
    async with rt.deployment(key).lock:
        try:
            result = await remove_deployment(rt.store, rt.keys, namespace, name, writer=rt.writer,
                                             serialize=rt.placement_lock, memo=rt.fleet_memo,
                                             nodes=rt.placement_nodes(),
                                             assignments=rt.assignments)
        except ConflictError as e:
            metrics.TXN_CONFLICTS.inc(e.conflicts)
            raise kopf.TemporaryError(str(e), delay=1) from e
        except StoreError as e:
            raise kopf.TemporaryError(f"etcd: {e}", delay=5) from e
        metrics.TXN_CONFLICTS.inc(result.conflicts)
        logger.info("removed assignments of %s/%s from %s", namespace, name,
                    list(result.decision.removed))
    rt.forget(key)
    rt.wake_canary(key)  # a Canary of a deleted target fails
    metrics.forget_deployment(namespace, name)
