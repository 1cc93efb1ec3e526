"""The chaos network proxy on loopback, in front of an echo server: pass, blackhole, reset,
delay. A blackhole must hang (not refuse) and deliver what waited once healed."""

from __future__ import annotations

import asyncio
import time

import pytest

from jetctl.netproxy import NetProxy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


async def _echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def _roundtrip(port: int, payload: bytes, timeout: float = 2.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.readexactly(len(payload)), timeout)
    finally:
        writer.close()


async def test_modes() -> None:
    echo = await _echo_server()
    proxy = NetProxy(("127.0.0.1", echo.sockets[0].getsockname()[1]))
    await proxy.start()
    assert await _roundtrip(proxy.port, b"hello") == b"hello"

    # blackhole: an open connection goes silent, a new one connects but hangs
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    proxy.set_mode("blackhole")
    writer.write(b"held")
    await writer.drain()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(reader.readexactly(4), 0.5)
    fresh_r, fresh_w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", proxy.port), 2)
    fresh_w.write(b"late")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(fresh_r.readexactly(4), 0.5)
    proxy.set_mode("pass")  # healed: what waited is delivered
    assert await asyncio.wait_for(reader.readexactly(4), 2) == b"held"
    assert await asyncio.wait_for(fresh_r.readexactly(4), 2) == b"late"

    proxy.set_mode("reset")
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(reader.readexactly(1), 2)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await _roundtrip(proxy.port, b"x")

    proxy.set_mode("delay", delay_s=0.3)
    t0 = time.monotonic()
    assert await _roundtrip(proxy.port, b"slow") == b"slow"
    assert time.monotonic() - t0 >= 0.6  # one delay each way
    for w in (writer, fresh_w):
        w.close()
    await proxy.stop()
    echo.close()
