"""An in-process asyncio TCP proxy that can cut the link: pass, blackhole, reset or delay.

Chaos tests and `jetctl chaos` put one between the client nodes and a model's server
(clients reach it through `JETCTL_ENDPOINT_OVERRIDE`, see `jetctl.faults`):

    proxy = ProxyThread(("127.0.0.1", server_port))    # its own event loop, in a thread
    proxy.set_mode("blackhole")                         # the link goes silent
    proxy.set_mode("pass")                              # healed

* `pass`: bytes flow both ways.
* `blackhole`: nothing flows and nothing is refused: open connections stop being read
  (bytes wait in the kernel's buffers, as in-flight packets do), new connections are
  accepted but not forwarded, so a connect hangs. Only timeouts and keepalive notice.
  After healing, what waited is delivered, like retransmitted packets.
* `reset`: every connection, open or new, is closed with a TCP RST (SO_LINGER 0).
* `delay`: every chunk waits `delay_s` before it is forwarded.

Left out: packet loss and truncation (`unshare -n` + `iptables` does those for real).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from typing import Literal

Mode = Literal["pass", "blackhole", "reset", "delay"]
MODES: tuple[str, ...] = ("pass", "blackhole", "reset", "delay")
CHUNK = 64 * 1024


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class NetProxy:
    """The proxy itself; every method runs on its event loop."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = target
        self.host = host
        self.port = port
        self.mode: Mode = "pass"
        self.delay_s = 0.0
        self.connections = 0  # accepted so far
        self._open: set[asyncio.StreamWriter] = set()
        self._gate = asyncio.Event()
        self._gate.set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._open):
            w.transport.abort()
        self._gate.set()

    def set_mode(self, mode: Mode, delay_s: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        if delay_s is not None:
            self.delay_s = delay_s
        if mode == "blackhole":
            self._gate.clear()
        else:
            self._gate.set()
        if mode == "reset":
            for w in list(self._open):
                _rst(w)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._open.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            await self._gate.wait()  # blackhole: the connect hangs here
            if self.mode == "reset":
                _rst(writer)
                return
            try:
                up_reader, upstream = await asyncio.open_connection(*self.target)
            except OSError:
                _rst(writer)  # the server is down: the client sees a reset, as it would
                return
            self._open.add(upstream)
            await asyncio.gather(
                self._pump(reader, upstream), self._pump(up_reader, writer),
                return_exceptions=True,
            )
        finally:
            for w in (writer, upstream):
                if w is not None:
                    self._open.discard(w)
                    if self.mode == "reset":
                        w.transport.abort()
                    else:
                        w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._gate.wait()
                data = await src.read(CHUNK)
                if not data:
                    break
                await self._gate.wait()  # cut while we were reading: hold the bytes
                if self.mode == "delay" and self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)
                if self.mode == "reset":
                    break
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()


class ProxyThread:
    """A `NetProxy` on its own event loop in a daemon thread; methods are thread-safe."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1", port: int = 0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="netproxy", daemon=True)
        self._thread.start()
        self.proxy = asyncio.run_coroutine_threadsafe(
            self._make(target, host, port), self._loop
        ).result(timeout=10)

    async def _make(self, target: tuple[str, int], host: str, port: int) -> NetProxy:
        proxy = NetProxy(target, host, port)  # its Event belongs to this loop
        await proxy.start()
        return proxy

    @property
    def endpoint(self) -> str:
        return f"{self.proxy.host}:{self.proxy.port}"

    @property
    def mode(self) -> Mode:
        return self.proxy.mode

    def set_mode(self, mode: Mode, delay_s: float | None = None) -> None:
        done = threading.Event()

        def apply() -> None:
            self.proxy.set_mode(mode, delay_s)
            done.set()

        self._loop.call_soon_threadsafe(apply)
        done.wait(10)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
