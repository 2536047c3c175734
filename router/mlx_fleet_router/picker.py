"""Which Macs to try for one request, in order: a pure function.

:func:`pick` (ring, deployment, session key, candidates, traffic split, ``now``) → :class:`Pick`,
its ordered :class:`Target` list. Two steps:

1. **Revision** — the canary split (:func:`mlx_fleet.routing.split.choose`, the agents' own
   bucket hash: one implementation) picks the candidate or the stable side for the session, as
   :func:`mlx_fleet.routing.route.route` does on an agent: the chosen revision's Macs; a
   candidate no eligible Mac holds falls back to the stable revision; a stable revision no
   eligible Mac holds falls back to any other non-candidate revision (a rolling update's
   previous one), then to the candidate. Each target names the revision the router pins
   (:data:`~mlx_fleet.routing.headers.PIN_HEADER`), so the agent does not split again. Without a
   split (or one naming no candidate revision) every candidate is eligible and nothing is
   pinned (``revision == ""``): the agent serves its stable revision. A split at weight 0 (or
   with the agents' guard tripped) still sorts the Macs: the stable revision's, the
   candidate's only as the last resort.
2. **Mac** — consistent hashing with bounded loads (CHWBL: Mirrokni, Thorup and Zadimoghaddam,
   "Consistent Hashing with Bounded Loads", SODA 2018, arXiv:1608.01350, 2016; as KubeAI's model
   proxy uses it, ``internal/loadbalancer/balance_chwbl.go``). Each Mac has
   :data:`REPLICATION` virtual nodes on a 64-bit ring; the key's point is looked up and the
   ring walked clockwise, each Mac taken at its first virtual node. With ``n`` eligible Macs of
   the chosen revision and ``total`` their in-flight requests, the **load bound** is ::

       capacity = ceil(load_factor × (total + 1) / n)

   (the mean in-flight counting this request, times the factor, rounded up: the paper's
   ``⌈c·m/n⌉`` with ``m`` balls including the new one). A Mac takes the request when
   ``in_flight + 1 ≤ capacity``; one above it is skipped to the next on the ring. Some Mac always
   fits (``n × capacity ≥ total + 1``), so the first target never exceeds the bound — unless
   every Mac within it is at its admission limit (below). KubeAI compares ``load + 1`` with the
   unrounded ``load_factor × (total + 1) / n``; the ceiling is the paper's and keeps one Mac
   always within bounds.

Eligible: not cordoned, its breaker admits a request now (:func:`breaker.admits`: closed,
or half-open with its one trial free), and it may serve what the request needs (``needs``,
:func:`mlx_fleet.capabilities.required_capabilities`: its capabilities
:func:`~mlx_fleet.capabilities.satisfies` them, or they are unknown and its assignment's
task fits the endpoint: :func:`~mlx_fleet.capabilities.may_serve`). A canary revision
without the capability is thus skipped like one without an eligible Mac (the split falls back
to the stable side). The targets are every eligible Mac of the chosen
revision, ordered: within the bound and below its admission limit first, then above the bound,
then at its admission limit (``in_flight ≥ max_in_flight``), each group in ring order from the
key — and, when the request needs more than its endpoint's task
(:func:`~mlx_fleet.capabilities.beyond_task`: tools, a response format, logprobs, ``n``), all
Macs whose capabilities are known ahead of those whose are unknown (an older agent in a rolling
upgrade, a standby never loaded: it may only answer 400, which is not retried). The caller tries them in order (:mod:`~mlx_fleet_router.retry`), re-asking the breaker
before each attempt.

Properties (``tests/test_router_picker.py``, hypothesis): deterministic, whatever the
candidates' order; the bound holds; a Mac that joins takes keys only for itself, one that leaves
moves only its own keys (on the ring owner, which the bound's spill may override); a session on
the candidate at weight *w* stays there at any larger weight (the split's buckets are monotone).

Pure: standard library, :mod:`mlx_fleet.contract`, :mod:`mlx_fleet.capabilities`,
:mod:`mlx_fleet.routing.split` and :mod:`~mlx_fleet_router.breaker`.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from mlx_fleet.capabilities import (TASK_TEXT_GENERATION, ModelCapabilities, Need, Task,
                                    beyond_task, may_serve)
from mlx_fleet.contract import TrafficSplit
from mlx_fleet.routing.split import choose, is_active

from . import breaker

__all__ = ["REPLICATION", "LOAD_FACTOR", "Ring", "Candidate", "Target", "Pick", "capacity",
           "pick"]

#: Virtual nodes per Mac on the ring: KubeAI's PrefixHash ``replication`` default (256).
REPLICATION = 256
#: Load bound factor: KubeAI's PrefixHash ``meanLoadFactor`` default (125 %), issue #17's 1.25.
LOAD_FACTOR = 1.25


def _point(*parts: str) -> int:
    """A 64-bit ring position: the first 8 bytes, big-endian, of SHA-256 over each part's UTF-8
    bytes preceded by its length (8 bytes, big-endian). hashlib, never the salted ``hash()``:
    every router replica and restart places a key at the same point."""
    h = hashlib.sha256()
    for part in parts:
        b = part.encode("utf-8", "replace")
        h.update(len(b).to_bytes(8, "big"))
        h.update(b)
    return int.from_bytes(h.digest()[:8], "big")


@dataclass(frozen=True, slots=True)
class Ring:
    """The hash ring of one deployment's Macs: ``points`` sorted ascending, ``owners[i]`` the
    Mac (node name) at ``points[i]``, ``names`` the set of Macs. Build it with :meth:`build`
    when the set of Macs changes (``len(names) × replication`` SHA-256s), not per request;
    Macs that are momentarily ineligible stay on it (:func:`pick` skips them, which gives the
    same order as a ring without them)."""

    points: tuple[int, ...]
    owners: tuple[str, ...]
    #: The Macs on the ring (computed once: :func:`pick` checks its candidates against it).
    names: frozenset[str]

    @classmethod
    def build(cls, names: Iterable[str], replication: int = REPLICATION) -> Ring:
        """The ring of ``names`` with ``replication`` virtual nodes each; virtual node ``i`` of
        Mac ``m`` is at ``_point("vnode", m, str(i))``. Ties (2**-64 likely) order by name."""
        if replication < 1:
            raise ValueError(f"replication must be >= 1, got {replication}")
        entries = sorted((_point("vnode", name, str(i)), name)
                         for name in set(names) for i in range(replication))
        owners = tuple(n for _, n in entries)
        return cls(tuple(p for p, _ in entries), owners, frozenset(owners))

    def walk(self, point: int) -> Iterator[str]:
        """Each Mac once, in ring order from the first virtual node at or after ``point``
        (wrapping around)."""
        n = len(self.points)
        start = bisect.bisect_left(self.points, point)
        seen: set[str] = set()
        for i in range(n):
            name = self.owners[(start + i) % n]
            if name not in seen:
                seen.add(name)
                yield name


def key_point(deployment: str, key: str) -> int:
    """Where session ``key`` of ``deployment`` (``"namespace/name"``) lands on the ring. The
    deployment is hashed too, so one client's sessions of different models spread apart."""
    return _point("key", deployment, key)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One Ready replica of the requested deployment: the Mac ``name`` (its node name, its
    identity on the ring), its ``endpoint`` (base URL) and the ``revision`` it serves (a Mac
    holding two revisions is two candidates). ``in_flight``: the router's requests to this Mac
    for this deployment now, not yet finished (KubeAI counts per model endpoint too).
    ``breaker``: its circuit breaker. ``cordoned``: its Mac is cordoned (drained: no new
    requests). ``max_in_flight``: the agent's admission limit (concurrent requests it
    takes before answering 429), None when unknown or unlimited. ``capabilities``: what its
    revision serves (None: unknown); ``task``: its assignment's (known even then)."""

    name: str
    revision: str
    endpoint: str = ""
    in_flight: int = 0
    breaker: breaker.State = breaker.CLOSED
    cordoned: bool = False
    max_in_flight: int | None = None
    capabilities: ModelCapabilities | None = None
    task: Task = TASK_TEXT_GENERATION

    def may_serve(self, needs: frozenset[Need]) -> bool:
        """Its capabilities satisfy ``needs``, or they are unknown and its task fits the
        endpoint (its agent decides the rest): :func:`mlx_fleet.capabilities.may_serve`."""
        return may_serve(self.capabilities, needs, self.task)


@dataclass(frozen=True, slots=True)
class Target:
    """One Mac to try: ``name``, ``endpoint``, and the ``revision`` to pin (``""``: no pin)."""

    name: str
    endpoint: str
    revision: str


@dataclass(frozen=True, slots=True)
class Pick:
    """The decision for one request.

    ``targets``: the Macs to try, in order (empty: none can serve now → 503).
    ``role``/``bucket``: the split's side for the session and its bucket (None without a
    split); ``canary``: an active split (:func:`~mlx_fleet.routing.split.is_active`) decided
    (the outcome feeds per-revision statistics). ``owner``: the key's Mac on the ring before
    the load bound (``""`` when no target); ``capacity``: the load bound in requests (0 when
    no target). ``saturated``: every target is at its admission limit (→ the backpressure
    queue, :mod:`~mlx_fleet_router.limits`)."""

    targets: tuple[Target, ...]
    role: Literal["stable", "candidate"] = "stable"
    bucket: int | None = None
    canary: bool = False
    owner: str = ""
    capacity: int = 0
    saturated: bool = False

    @property
    def spilled(self) -> bool:
        """The load bound sent the request past its ring owner (affinity lost this time)."""
        return bool(self.targets) and self.targets[0].name != self.owner


def capacity(load_factor: float, total_in_flight: int, macs: int) -> int:
    """The load bound: ``ceil(load_factor × (total_in_flight + 1) / macs)`` requests, computed
    exactly (``load_factor`` taken as its decimal ``repr``: 1.1 is 11/10, not the binary float
    just above it). Raises ValueError for ``macs < 1``, ``load_factor < 1`` or a negative
    total."""
    if macs < 1 or total_in_flight < 0:
        raise ValueError(f"need macs >= 1 and total_in_flight >= 0 (got {macs}, "
                         f"{total_in_flight})")
    c = Fraction(repr(float(load_factor)))
    if c < 1:
        raise ValueError(f"load_factor must be >= 1, got {load_factor}")
    return math.ceil(c * (total_in_flight + 1) / macs)


def _tiers(candidates: Sequence[Candidate], split: TrafficSplit | None, key: str,
           guard_tripped: bool) -> Iterator[tuple[list[Candidate], str, str, int | None]]:
    """(candidates, role, pinned revision or "" or "*" (each its own), bucket), in order of
    preference."""
    if split is None or not split.candidate_revision:
        yield list(candidates), "stable", "", None
        return
    choice = choose(split, key, guard_tripped=guard_tripped)
    cand, stable = split.candidate_revision, split.stable_revision
    if choice.role == "candidate":
        yield [c for c in candidates if c.revision == cand], "candidate", cand, choice.bucket
    yield [c for c in candidates if c.revision == stable], "stable", stable, choice.bucket
    yield [c for c in candidates if c.revision not in (cand, stable)], "stable", "*", choice.bucket
    if choice.role != "candidate":
        yield [c for c in candidates if c.revision == cand], "candidate", cand, choice.bucket


def pick(ring: Ring, deployment: str, key: str, candidates: Sequence[Candidate],
         split: TrafficSplit | None = None, *, now: float,
         breaker_config: breaker.BreakerConfig = breaker.BreakerConfig(),
         load_factor: float = LOAD_FACTOR, guard_tripped: bool = False,
         needs: frozenset[Need] = frozenset()) -> Pick:
    """The Macs to try for the request with session ``key``
    (:func:`mlx_fleet.routing.session.session_key`) to ``deployment`` (``"namespace/name"``),
    in order (module docstring). ``candidates``: the deployment's Ready replicas, in any order;
    every name must be on ``ring`` (ValueError otherwise: the caller's ring is stale).
    ``split``: the deployment's traffic split, None when no canary runs. ``now``: seconds of
    a monotonic clock (the breakers' clock). ``guard_tripped``: the agents reported the local
    guard tripped (everything goes stable). ``needs``: what the request needs
    (:func:`mlx_fleet.capabilities.required_capabilities`); a candidate that lacks one is not
    eligible."""
    missing = {c.name for c in candidates} - ring.names
    if missing:
        raise ValueError(f"candidates not on the ring (rebuild it): {sorted(missing)}")
    eligible = sorted((c for c in candidates
                       if not c.cordoned and breaker.admits(breaker_config, c.breaker, now)
                       and c.may_serve(needs)),
                      key=lambda c: (c.name, c.revision))
    for tier, role, pin, bucket in _tiers(eligible, split, key, guard_tripped):
        by_name: dict[str, Candidate] = {}
        for c in tier:
            by_name.setdefault(c.name, c)
        if not by_name:
            continue
        bound = capacity(load_factor, sum(c.in_flight for c in by_name.values()), len(by_name))
        # a request that needs more than its endpoint's task tries the Macs known to serve it
        # before those whose capabilities are unknown (an older agent, a standby never loaded
        # here: it may answer 400, which is not retried)
        unsure = beyond_task(needs)
        order: list[tuple[int, int, Candidate]] = []
        walk = (n for n in ring.walk(key_point(deployment, key)) if n in by_name)
        for i, name in enumerate(walk):
            c = by_name[name]
            at_limit = c.max_in_flight is not None and c.in_flight >= c.max_in_flight
            rank = 2 if at_limit else (1 if c.in_flight + 1 > bound else 0)
            order.append((rank, i, c))
            if len(order) == len(by_name):
                break
        order.sort(key=lambda t: (unsure and t[2].capabilities is None, t[0], t[1]))
        targets = tuple(Target(c.name, c.endpoint, c.revision if pin == "*" else pin)
                        for _, _, c in order)
        return Pick(targets, role=role, bucket=bucket, canary=is_active(split),
                    owner=min(order, key=lambda t: t[1])[2].name, capacity=bound,
                    saturated=all(rank == 2 for rank, _, _ in order))
    split_on = split is not None and bool(split.candidate_revision)
    choice = choose(split, key, guard_tripped=guard_tripped) if split_on else None
    return Pick((), role=choice.role if choice else "stable",
                bucket=choice.bucket if choice else None, canary=is_active(split))
