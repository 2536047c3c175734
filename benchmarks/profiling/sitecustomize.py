"""Profile a Python process of the benchmark (``controlplane.py --profile``).

Put this directory on the child's ``PYTHONPATH`` with ``MLXF_PROFILE_OUT=/path/file.prof``:
Python imports ``sitecustomize`` at start-up, so the main thread's calls (the event loop) and
those of every thread started later (the ``asyncio.to_thread`` workers: Kubernetes API calls)
are recorded by :mod:`cProfile`. ``SIGUSR1`` writes the statistics so far to that file (the
benchmark sends it once everything is Ready, so the profile covers start-up and convergence).
Without the variable this module does nothing.
"""

import os

_OUT = os.environ.get("MLXF_PROFILE_OUT")
if _OUT:
    import cProfile
    import signal
    import sys
    import threading

    _main = cProfile.Profile()
    _threads: list = []

    def _thread_start(*_args):
        """The first profile event of a new thread: hand the thread its own profiler."""
        sys.setprofile(None)
        p = cProfile.Profile()
        _threads.append(p)
        p.enable()

    def _dump(*_args) -> None:
        import pstats

        try:
            _main.disable()
            stats = pstats.Stats(_main)
            for p in list(_threads):
                try:
                    stats.add(p)  # (a thread's profiler keeps running; its snapshot is taken)
                except TypeError:  # pstats refuses a profiler that recorded nothing
                    pass
            stats.dump_stats(_OUT)
        except Exception:  # a signal handler's exception would land in whatever code ran
            import traceback

            with open(_OUT + ".error", "w") as f:
                traceback.print_exc(file=f)

    threading.setprofile(_thread_start)
    signal.signal(signal.SIGUSR1, _dump)
    _main.enable()
