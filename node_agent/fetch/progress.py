"""Download progress: counts bytes and files, measures the rate, and reports at a bounded rate.

:class:`~mlx_fleet.contract.DownloadProgress` is passed to the ``progress`` callback at most
every ``progress_interval_s`` (and once at the end, complete): ``bytes_done`` counts bytes on
disk (resumed ones included), ``bytes_total`` the sum of the files' sizes (0 while one is
unknown), ``rate_bytes_per_second`` the bytes received over the last :data:`RATE_WINDOW_S`
seconds, ``eta_seconds`` remaining ÷ rate (None without a rate or a total). The callback runs
on the event loop; an exception from it is logged and ignored. Times come from
``time.monotonic()``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from mlx_fleet.contract import DownloadProgress

log = logging.getLogger("node_agent.fetch")  # the name its log lines always had

ProgressCallback = Callable[[DownloadProgress], None]

#: Least interval between two progress callbacks (seconds).
PROGRESS_INTERVAL_S = 0.5
#: The transfer rate is averaged over this many seconds.
RATE_WINDOW_S = 5.0


def _ignore(_: DownloadProgress) -> None:
    pass


class _Progress:
    """Counts bytes and files, measures the rate, and calls the callback at a bounded rate."""

    def __init__(self, callback: ProgressCallback, interval: float) -> None:
        self._callback = callback
        self._interval = interval
        self._last_emit: float | None = None
        self.expected: dict[str, int | None] = {}   # path → size (None: unknown yet)
        self.local: dict[str, int] = {}             # path → bytes on disk
        self.done: set[str] = set()
        self.wire = 0                               # bytes received by this call
        self._samples: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])
        # (hub) values that override the per-file accounting
        self.override: tuple[int, int, int, int] | None = None

    def received(self, path: str, n: int) -> None:
        self.local[path] = self.local.get(path, 0) + n
        self.wire += n
        now = time.monotonic()
        if now - self._samples[-1][0] >= 0.1:
            self._samples.append((now, self.wire))
        self.maybe_emit()

    def set_wire(self, n: int) -> None:
        """Set the bytes received so far (for sources that count them elsewhere)."""
        self.wire = n
        self._samples.append((time.monotonic(), n))
        self.maybe_emit()

    def rate(self, now: float) -> float:
        window_start = now - RATE_WINDOW_S
        while len(self._samples) > 1 and self._samples[1][0] <= window_start:
            self._samples.popleft()
        t0, w0 = self._samples[0]
        if now - t0 < 1e-3 or self.wire <= w0:
            return 0.0
        return (self.wire - w0) / (now - t0)

    def snapshot(self) -> DownloadProgress:
        now = time.monotonic()
        if self.override is not None:
            done, total, files_done, files_total = self.override
        else:
            sizes = list(self.expected.values())
            total = sum(sizes) if sizes and None not in sizes else 0  # type: ignore[arg-type]
            done = sum(self.local.values())
            files_done, files_total = len(self.done), len(self.expected)
        rate = self.rate(now)
        eta = max(total - done, 0) / rate if rate > 0 and total > 0 else None
        return DownloadProgress(bytes_done=max(done, 0), bytes_total=max(total, 0),
                                rate_bytes_per_second=rate, eta_seconds=eta,
                                files_done=files_done, files_total=files_total)

    def maybe_emit(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and self._last_emit is not None and now - self._last_emit < self._interval:
            return
        self._last_emit = now
        try:
            self._callback(self.snapshot())
        except Exception:  # noqa: BLE001 - a reporting bug must not fail the download
            log.exception("download progress callback failed")
