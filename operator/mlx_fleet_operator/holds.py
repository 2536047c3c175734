"""Vanished nodes held or re-placed: the timers around :mod:`.disruption`'s pure rule.

Node records vanish one watch event at a time, so a vanished node is judged
:data:`~.disruption.DISRUPTION_WINDOW_SECONDS` after it went, together with every other node
gone by then (its replicas are kept meanwhile); a node that appears or comes back is observed
at once. When the rule holds nodes (a control-plane disruption), a timer observes again when
the hold ends. :class:`NodeHolds` keeps that state; the nodes follower (:mod:`.followers`)
feeds it and placement asks it which nodes to keep (:meth:`NodeHolds.held`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable

from .disruption import DISRUPTION_WINDOW_SECONDS, HOLD_SECONDS, Disruption, observe

__all__ = ["NodeHolds"]

log = logging.getLogger(__name__)


class NodeHolds:
    """The disruption state of the fleet and its timers.

    ``live``: the node names whose records exist now; ``on_release(names, what)``: called with
    nodes whose replicas are to be re-placed now (``what``: ``"gone"`` — judged node loss — or
    ``"released"`` — a hold ended); ``clock``: seconds, monotonic (tests replace it)."""

    def __init__(self, live: Callable[[], Collection[str]],
                 on_release: Callable[[set[str], str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._live = live
        self._on_release = on_release
        self.clock = clock
        #: Nodes that vanished together (:mod:`.disruption`): whose replicas are held.
        self.disruption = Disruption()
        #: Nodes whose record vanished less than ``DISRUPTION_WINDOW_SECONDS`` ago, not yet
        #: judged (node loss or part of a disruption): their replicas are held meanwhile.
        self.vanishing: set[str] = set()
        self._judge_timer: asyncio.TimerHandle | None = None
        self._hold_timer: asyncio.TimerHandle | None = None

    def held(self) -> frozenset[str]:
        """The vanished nodes whose replicas placement keeps (``place(held=...)``): those of a
        disruption, and those that vanished within the last window and are not judged yet."""
        live = self._live()
        return frozenset(n for n in self.disruption.held | self.vanishing if n not in live)

    def start(self, names: Iterable[str]) -> None:
        """The nodes seen at start-up: what a later mass loss is measured against."""
        self.disruption = observe(self.disruption, set(names), self.clock())

    def vanished(self, name: str) -> None:
        """A node record went away: judge it with whatever else vanishes within
        :data:`~.disruption.DISRUPTION_WINDOW_SECONDS` (etcd deletes the records of expired
        leases one by one, a few milliseconds apart)."""
        self.vanishing.add(name)
        if self._judge_timer is None:
            self._judge_timer = asyncio.get_running_loop().call_later(
                DISRUPTION_WINDOW_SECONDS, self.judge)

    def seen(self, names: Iterable[str]) -> None:
        """Node records ``names`` (present now) appeared or changed: outside a window, update the
        nodes seen (and release held nodes that are back); inside one, the judgement at its end
        does. Costs O(len(names)): a heartbeat of one of a thousand Macs touches one name."""
        names = set(names)
        self.vanishing -= names
        if self._judge_timer is None and (names - self.disruption.seen
                                          or names & self.disruption.held):
            self.observe()

    def judge(self) -> None:
        """Judge the nodes vanished in the window (what its timer runs; cancels the timer)."""
        if self._judge_timer is not None:
            self._judge_timer.cancel()
            self._judge_timer = None
        gone = self.vanishing - set(self._live())
        self.vanishing = set()
        before = self.disruption.held
        known = len(self.disruption.seen - before)
        self.observe()
        held = self.disruption.held - before
        if held:
            log.warning("%d of %d nodes vanished within %.0f s (%s): treating it as a control-"
                        "plane disruption, not node failures; their replicas are held for up "
                        "to %.0f s while the agents re-register", len(held), known,
                        DISRUPTION_WINDOW_SECONDS, ", ".join(sorted(held)), HOLD_SECONDS)
        self._on_release(gone - self.disruption.held, "gone")

    def observe(self) -> None:
        """:func:`~.disruption.observe` the live nodes now; release what a hold no longer
        keeps and arm the timer of the hold's end (what that timer runs)."""
        now = self.clock()
        live = set(self._live())
        before = self.disruption.held
        self.disruption = observe(self.disruption, live, now, hold_seconds=HOLD_SECONDS)
        released = before - self.disruption.held
        if released:
            back = released & live
            if back:
                log.info("held node(s) back: %s", ", ".join(sorted(back)))
            if released - back:
                log.warning("held node(s) not back after %.0f s: %s; re-placing their "
                            "replicas", HOLD_SECONDS, ", ".join(sorted(released - back)))
            self._on_release(set(released), "released")
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if self.disruption.held:
            self._hold_timer = asyncio.get_running_loop().call_later(
                max(self.disruption.until - now, 0.0) + 0.01, self.observe)

    def close(self) -> None:
        """Cancel the timers (the operator is stopping)."""
        for timer in (self._judge_timer, self._hold_timer):
            if timer is not None:
                timer.cancel()
        self._judge_timer = self._hold_timer = None
