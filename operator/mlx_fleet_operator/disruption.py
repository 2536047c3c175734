"""Nodes that vanish together: a control-plane disruption, not node failures.

A Mac whose lease expires has its node record deleted by etcd; placement then moves its replicas
elsewhere (node loss). But when *most* Macs vanish at once, the likelier cause is the control
plane: an etcd that was frozen (SIGSTOP, a VM pause, a long GC stop) revokes every agent's lease
as it resumes — their keep-alives could not reach it — and the agents, which kept serving,
re-register within a keep-alive interval. Re-placing in that gap would unassign every replica
and make the agents unload models they are serving. Kubernetes' node lifecycle controller has the
same rule: when a zone's not-ready fraction exceeds ``--unhealthy-zone-threshold`` (0.55) it stops
evicting ("full disruption"; kube-controller-manager flags). Here: when more than
:data:`MASS_LOSS_FRACTION` of the nodes last seen vanish between two observations (at least
:data:`MASS_LOSS_MIN_NODES` of them), their replicas are *held* — kept assigned, not re-placed,
given no new replicas — until they come back or :data:`HOLD_SECONDS` pass, whichever is first.
A single Mac lost in a fleet of two or more is still re-placed at once.

Pure: :func:`observe` maps the previous :class:`Disruption` and the live node names at a time to
the next, and placement keeps the replicas of :attr:`Disruption.held` (``place(held=...)``).
The operator (:mod:`.holds`) feeds it from its nodes follower: node records vanish one
watch event at a time, so a vanished node is judged :data:`DISRUPTION_WINDOW_SECONDS` after it
went, together with every other node gone by then (its replicas are kept meanwhile); a node
that appears or comes back is observed at once.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Disruption", "observe", "MASS_LOSS_FRACTION", "MASS_LOSS_MIN_NODES", "HOLD_SECONDS",
           "DISRUPTION_WINDOW_SECONDS"]

#: More than this fraction of the nodes seen must vanish at once to count as a disruption
#: (Kubernetes' ``--unhealthy-zone-threshold`` default).
MASS_LOSS_FRACTION = 0.55
#: ... and at least this many (one Mac of one is node loss: nothing else could serve it anyway).
MASS_LOSS_MIN_NODES = 2
#: How long vanished nodes' replicas are held (seconds): long enough for agents to re-register
#: after etcd returns (they retry every ≤ 2 s and re-register at once), short enough that Macs
#: that really died are replaced well within a minute.
HOLD_SECONDS = 30.0
#: How long after a node record vanishes the operator judges it, with every other node gone
#: by then (seconds): etcd deletes the records of leases it revokes together within a few
#: milliseconds; an ordinary node loss is re-placed this much later.
DISRUPTION_WINDOW_SECONDS = 1.0


@dataclass(frozen=True)
class Disruption:
    """``seen``: the node names alive at the last observation, plus those held; ``held``: the
    vanished nodes whose replicas are held; ``until``: when the hold ends (the clock of
    :func:`observe`'s ``now``, seconds)."""

    seen: frozenset[str] = frozenset()
    held: frozenset[str] = frozenset()
    until: float = 0.0


def observe(prev: Disruption, live: frozenset[str] | set[str], now: float, *,
            fraction: float = MASS_LOSS_FRACTION, min_nodes: int = MASS_LOSS_MIN_NODES,
            hold_seconds: float = HOLD_SECONDS) -> Disruption:
    """The disruption state after seeing the nodes ``live`` at ``now``.

    Nodes of ``prev.held`` that are live again are released; the rest stay held until
    ``prev.until``. Of the nodes seen before and not held, those missing now count as a mass
    loss if they are at least ``min_nodes`` and more than ``fraction`` of the nodes seen: they
    are held until ``now + hold_seconds`` (a later mass loss extends the hold of all). Anything
    else missing is ordinary node loss (not held).
    """
    live = frozenset(live)
    held = prev.held - live if now < prev.until else frozenset()
    until = prev.until if held else 0.0
    before = prev.seen - prev.held
    gone = before - live
    if before and len(gone) >= min_nodes and len(gone) > fraction * len(before):
        held |= gone
        until = now + hold_seconds
    return Disruption(seen=live | held, held=held, until=until)
