"""Child processes that never outlive their parent, and readiness waits that never sleep blindly.

Every process the local fleet starts (etcd, kube-apiserver, the operator, agents) goes through
:class:`ManagedProcess`: its output goes to a log file, it runs in its own process group (a
terminal's Ctrl-C reaches only us, and we stop children in order), it is asked to exit with
SIGTERM and killed after a grace period, and on Linux the kernel kills it if the parent dies
(``PR_SET_PDEATHSIG``, set by util-linux's ``setpriv --pdeathsig KILL`` which then execs the
command), so even a SIGKILLed test run leaves no process behind. One window remains: a parent
killed in the instant between the fork and setpriv's ``prctl`` (before the command is exec'd)
leaves that child running — no mechanism of the kernel's can report it.

No Python code runs between fork and exec (no ``preexec_fn``): the parent has gRPC and MLX
threads, and running the interpreter in a child forked from such a process is unsafe — it
segfaulted in ``threading._after_fork`` about once in four test runs before this was changed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


class ProcessFailed(RuntimeError):
    """A managed process exited or never became ready; the message names its log file."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the kernel's ephemeral pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent_prefix() -> list[str]:
    """``setpriv --pdeathsig KILL`` on Linux when util-linux provides it, else nothing (macOS:
    children are still stopped by :meth:`ManagedProcess.stop`, just not on a SIGKILLed parent)."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


class ManagedProcess:
    """One child process with its output in ``log_path``.

    ``name`` is used in messages. ``env`` is merged over ``os.environ``.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen([*_die_with_parent_prefix(), *self.argv], stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=full_env, cwd=cwd, process_group=0)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_until(self, check: Callable[[], bool], *, timeout: float, what: str,
                   interval: float = 0.1) -> None:
        """Poll ``check`` until it returns True. Raises :class:`ProcessFailed` at once if the
        process exits, or after ``timeout`` seconds, with the tail of its log."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise ProcessFailed(f"{self.name} exited with code {self.proc.returncode} before "
                                    f"{what}; log: {self.log_path}\n{self.log_tail()}")
            with contextlib.suppress(Exception):
                if check():
                    return
            if time.monotonic() > deadline:
                raise ProcessFailed(f"{self.name} not {what} after {timeout:.0f}s; "
                                    f"log: {self.log_path}\n{self.log_tail()}")
            time.sleep(interval)

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL. Returns the exit code."""
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crashing Mac would die; waits for the process to be reaped."""
        self.signal(signal.SIGKILL)
        self.proc.wait()
        self._log.close()
