"""The parked pool of MLX-owning threads.

MLX keeps thread-local state whose destructor needs the GIL. A thread that used MLX and exits
late (after ``join`` returned, while the interpreter finalizes) aborts the process. So MLX
threads never exit: when a core closes, its thread parks in this pool and the next core reuses
it. Parked threads are daemons and hold nothing.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Callable

__all__ = ["run_on_worker"]

log = logging.getLogger(__name__)

_idle_workers: "queue.SimpleQueue[queue.SimpleQueue[Callable[[], None]]]" = queue.SimpleQueue()
_worker_names = itertools.count(1)


def _worker_main(inbox: "queue.SimpleQueue[Callable[[], None]]") -> None:
    while True:
        job = inbox.get()
        try:
            job()
        except BaseException:  # noqa: BLE001 - a worker must survive its job
            log.exception("MLX worker job failed")
        _idle_workers.put(inbox)


def run_on_worker(job: Callable[[], None]) -> threading.Thread | None:
    """Run ``job`` on a parked MLX worker thread (or a new one). Returns the new thread, if any."""
    try:
        inbox = _idle_workers.get_nowait()
    except queue.Empty:
        inbox = queue.SimpleQueue()
        thread = threading.Thread(target=_worker_main, args=(inbox,), daemon=True,
                                  name=f"mlx-serving-{next(_worker_names)}")
        inbox.put(job)
        thread.start()
        return thread
    inbox.put(job)
    return None
