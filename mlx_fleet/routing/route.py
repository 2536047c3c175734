"""Which loaded revision (or which other node) serves one request on an agent: a pure function.

A served model name maps to one deployment on a node, which may hold several revisions at once
(:class:`~mlx_fleet.contract.Role`): ``Stable``, ``Previous`` (a rolling update's old revision,
until the stable one is Ready here) and ``Candidate`` (a canary's). :func:`route` decides:

1. With a :class:`~mlx_fleet.contract.TrafficSplit` (a canary runs) the session's bucket picks
   stable or candidate (:func:`mlx_fleet.routing.split.choose`; a tripped local guard always picks
   stable). A candidate that this node does not hold is *forwarded* to a node that does (one of
   ``candidate_endpoints``, chosen by the bucket, so a session sticks to one node); with none
   known it falls back to the stable revision — as the agent does when the node forwarded to
   answers 404 (it no longer holds the candidate: ``guard_tripped`` routes to stable).
2. Otherwise — and for the stable side of a split — the node serves its ``Stable`` revision;
   while that is not loaded yet, a ``Previous`` one (a revision edit never leaves a gap); as a
   last resort any loaded revision (a candidate-only node still answers).
3. A request that pins a revision (:data:`~mlx_fleet.routing.headers.PIN_HEADER`, set by a
   forwarding node) gets exactly that revision when it is loaded here, and is never forwarded
   again.
"""

from __future__ import annotations

import dataclasses

from mlx_fleet.contract import Role, TrafficSplit
from mlx_fleet.routing.split import choose, is_active

__all__ = ["Route", "route"]

_PREFERENCE = (Role.STABLE, Role.PREVIOUS, Role.CANDIDATE)


@dataclasses.dataclass(frozen=True)
class Route:
    """``revision``: serve this loaded revision here; or ``forward``: the base URL of the agent
    to forward to (then ``revision`` is the revision it must serve). ``canary``: True when the
    request is under a split (its outcome feeds the per-revision statistics). ``role``:
    ``"stable"`` or ``"candidate"`` side of the split."""

    revision: str
    forward: str = ""
    canary: bool = False
    role: str = "stable"


def _fallback(loaded: dict[str, Role], prefer: str = "") -> str | None:
    if prefer and prefer in loaded:
        return prefer
    for role in _PREFERENCE:
        for rev in sorted(loaded):
            if loaded[rev] == role:
                return rev
    return None


def route(loaded: dict[str, Role], split: TrafficSplit | None, key: str, *,
          guard_tripped: bool = False, pinned: str = "") -> Route | None:
    """``loaded``: revision → role of the deployment's revisions loaded on this node (may be
    empty). ``key``: the session key. Returns None when nothing here or elsewhere can serve."""
    if pinned:
        return Route(pinned, canary=split is not None) if pinned in loaded else None
    if not is_active(split):
        rev = _fallback(loaded)
        return Route(rev) if rev is not None else None
    assert split is not None
    choice = choose(split, key, guard_tripped=guard_tripped)
    if choice.role == "candidate":
        if choice.revision in loaded:
            return Route(choice.revision, canary=True, role="candidate")
        if split.candidate_endpoints:
            b = choice.bucket or 0
            return Route(choice.revision, canary=True, role="candidate",
                         forward=split.candidate_endpoints[b % len(split.candidate_endpoints)])
    stable = {r: role for r, role in loaded.items() if r != split.candidate_revision}
    rev = _fallback(stable, split.stable_revision)
    if rev is None:
        rev = _fallback(loaded)
        return Route(rev, canary=True, role="candidate") if rev is not None else None
    return Route(rev, canary=True, role="stable")
