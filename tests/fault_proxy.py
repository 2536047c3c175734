"""A TCP proxy for the fault suite: put it between an agent and etcd and make the network slow
(latency per forwarded chunk), silent (blackhole: bytes held, connections left open, as a
dropped route looks to both ends) or hostile (reset: every connection, open or new, closed with
a TCP RST). :meth:`FaultProxy.heal` restores plain forwarding (held bytes are then delivered, as
TCP would retransmit them).

It runs on an event loop of its own in a daemon thread: the test's loop is blocked at times by
synchronous helpers (``start_agent`` waits for ``/health``), and the agent's traffic must flow
then too. Only asyncio and the standard library.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from concurrent.futures import Future


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port``. :meth:`start` returns the
    listening port; :meth:`close` stops it and drops every connection."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy",
                                        daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._latency = 0.0
        self._mode = "pass"  # pass | blackhole | reset
        self._flowing: asyncio.Event | None = None
        self.port = 0

    # -- control (any thread) -------------------------------------------------------------------
    def start(self) -> int:
        self._thread.start()
        self.port = self._call(self._start()).result(10)
        return self.port

    def latency(self, seconds: float) -> None:
        """Delay every forwarded chunk by ``seconds`` (both directions)."""
        self._call(self._set("pass", seconds)).result(10)

    def blackhole(self) -> None:
        """Forward nothing from now on; connections stay open, new ones are accepted."""
        self._call(self._set("blackhole", 0.0)).result(10)

    def reset(self) -> None:
        """Reset every open connection (RST) and every new one, until :meth:`heal`."""
        self._call(self._set("reset", 0.0)).result(10)

    def heal(self) -> None:
        """Plain forwarding again, no latency."""
        self._call(self._set("pass", 0.0)).result(10)

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._close()).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # -- the proxy's loop -----------------------------------------------------------------------
    def _call(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self) -> int:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _set(self, mode: str, latency: float) -> None:
        assert self._flowing is not None
        self._mode, self._latency = mode, latency
        if mode == "blackhole":
            self._flowing.clear()
        else:
            self._flowing.set()
        if mode == "reset":
            for w in list(self._writers):
                _rst(w)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            _rst(w)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._mode == "reset":
            _rst(writer)
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self._target)
        except OSError:
            _rst(writer)
            return
        self._writers |= {writer, up_w}
        try:
            await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))
        finally:
            self._writers -= {writer, up_w}
            for w in (writer, up_w):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward ``reader`` to ``writer``; each chunk leaves ``latency`` after it arrived
        (pipelined, as on a long link: chunks do not queue behind each other's delay)."""
        assert self._flowing is not None
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            try:
                while data := await reader.read(65536):
                    await chunks.put((loop.time() + self._latency, data))
            except (ConnectionError, OSError):
                pass
            finally:
                await chunks.put((0.0, b""))

        reading = asyncio.create_task(read())
        try:
            while True:
                due, data = await chunks.get()
                if not data:
                    break
                await self._flowing.wait()  # a blackhole holds the bytes here
                if (delay := due - loop.time()) > 0:
                    await asyncio.sleep(delay)  # the injected latency, not a wait
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()
            _rst(writer) if self._mode == "reset" else writer.close()


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()
