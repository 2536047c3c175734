"""Every version of one Kubernetes object the API server sends, as it sends it.

``kubectl get KIND NAME -w -o json --output-watch-events`` in a background thread: the tests and
benchmarks check properties that must hold at *every* moment (``status.endpoints`` never empty
during a revision edit) and time transitions (a Canary's ``phase: RolledBack``) without polling.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable

from mlx_fleet.devcluster.controlplane import ControlPlane

__all__ = ["ObjectWatch"]


class ObjectWatch:
    """``events``: ``(time.monotonic(), object)`` per watch event, in order (the first is the
    object as it is when the watch starts). :meth:`wait` blocks until one satisfies a
    predicate. Stop with :meth:`stop` (or use it as a context manager)."""

    def __init__(self, cp: ControlPlane, kind: str, name: str, namespace: str) -> None:
        self.events: list[tuple[float, dict]] = []
        self._arrived = threading.Condition()
        self._proc = subprocess.Popen(
            [str(cp.binaries.kubectl), "get", kind, name, "-n", namespace, "-w", "-o", "json",
             "--output-watch-events"], env={**os.environ, **cp.env()},
            stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        decoder, buf = json.JSONDecoder(), ""
        for line in self._proc.stdout:
            buf += line
            try:
                ev, end = decoder.raw_decode(buf.lstrip())
            except json.JSONDecodeError:
                continue  # an object spans several lines: read on
            buf = buf.lstrip()[end:]
            with self._arrived:
                self.events.append((time.monotonic(), ev["object"]))
                self._arrived.notify_all()

    @property
    def statuses(self) -> list[dict]:
        return [o.get("status") or {} for _, o in self.events]

    def first(self, pred: Callable[[dict], bool]) -> float | None:
        """The time of the first event whose object satisfies ``pred``."""
        return next((t for t, o in self.events if pred(o)), None)

    def wait(self, pred: Callable[[dict], bool], timeout: float) -> dict:
        """The first object seen (already or from now on) that satisfies ``pred``; blocks
        (call it in a thread from async code). Raises ``TimeoutError`` after ``timeout``
        seconds, naming the last status seen."""
        with self._arrived:
            found = self._arrived.wait_for(
                lambda: next((o for _, o in self.events if pred(o)), None), timeout)
            if found is None:
                last = self.statuses[-1] if self.events else None
                raise TimeoutError(f"no object satisfied the condition in {timeout} s; "
                                   f"last status: {last}")
            return found

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(10)
        self._thread.join(10)

    def __enter__(self) -> ObjectWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
