"""A TCP proxy on 127.0.0.1 that gives a local server an object store's latency (and, if asked, a bandwidth cap).

Real object stores answer in 10-100 ms; a server on 127.0.0.1 answers in 0.1 ms, so a client that
waits for one request after another looks fast there and takes hours against GCS. Put this proxy in
front of the server and point the client at the proxy: every request then waits `delay` seconds
before it reaches the server, and every new connection waits `delay` too (its handshake). A request
is what the client sends after the server last answered on that connection (HTTP/1.1 keeps one
request at a time on a connection), so an upload sent in many TCP segments pays once.

With a delay D, a client that keeps K requests in flight pays about requests / K x D more in all;
one that waits for each answer before the next request pays requests x D.

    python tests/latency_proxy.py --target 127.0.0.1:PORT --delay-ms 30 [--mbps 1000]

prints `listening 127.0.0.1:PORT2` and serves until killed. In-process: `with LatencyProxy(...) as p: p.port`.
"""
from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Optional


class _Bandwidth:
    """A byte budget per second, shared by every connection in one direction (a token bucket)."""

    def __init__(self, bytes_per_second: float | None) -> None:
        self.rate = bytes_per_second
        self.allowance = 0.0
        self.stamp = time.monotonic()

    async def take(self, n: int) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        self.allowance = min(self.rate, self.allowance + (now - self.stamp) * self.rate) - n
        self.stamp = now
        if self.allowance < 0:
            await asyncio.sleep(-self.allowance / self.rate)


class LatencyProxy:
    """Forwards 127.0.0.1:`port` to `target` (host, port), each request and connection delayed."""

    def __init__(self, target: tuple[str, int], delay: float, bytes_per_second: float | None = None,
                 port: int = 0) -> None:
        self.target = target
        self.delay = delay
        self.port = port
        self.requests = 0  # requests forwarded (each paid the delay once)
        self.connections = 0
        self._up = _Bandwidth(bytes_per_second)
        self._down = _Bandwidth(bytes_per_second)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server: Optional[asyncio.base_events.Server] = None
        self._thread: Optional[threading.Thread] = None
        self._main: Optional[asyncio.Task] = None  # the listener's task (stop() ends it last)
        self._ready = threading.Event()

    async def _pump_up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answered: list[bool]) -> None:
        """Client to server: the first segment of each request waits the delay."""
        while data := await reader.read(1 << 16):
            if answered[0]:  # the server answered since the last request: this starts a new one
                answered[0] = False
                self.requests += 1
                await asyncio.sleep(self.delay)
            await self._up.take(len(data))
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _pump_down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answered: list[bool]) -> None:
        while data := await reader.read(1 << 16):
            answered[0] = True
            await self._down.take(len(data))
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        await asyncio.sleep(self.delay)  # the connection's handshake
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        answered = [True]
        tasks = [asyncio.ensure_future(self._pump_up(client_r, server_w, answered)),
                 asyncio.ensure_future(self._pump_down(server_r, client_w, answered))]
        try:
            await asyncio.gather(*tasks)
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            client_w.close()
            server_w.close()

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        async with self._server:
            await self._server.serve_forever()

    def start(self) -> "LatencyProxy":
        """Serve from a thread of this process; returns once listening (self.port)."""
        loop = self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            self._main = loop.create_task(self._serve())
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="latency-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("latency proxy did not start")
        return self

    def stop(self) -> None:
        """Close the listener and every connection, then end the thread (its loop is left to the
        collector: closing it under connections still unwinding only adds noise)."""
        loop = self._loop
        if loop is None:
            return

        def shut() -> None:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.call_later(0.2, loop.stop)  # (the cancelled connections unwind meanwhile)

        loop.call_soon_threadsafe(shut)
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "LatencyProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="HOST:PORT of the server")
    ap.add_argument("--delay-ms", type=float, default=30.0)
    ap.add_argument("--mbps", type=float, default=0.0, help="bandwidth cap each way in MB/s (0: none)")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    host, _, port = args.target.rpartition(":")
    proxy = LatencyProxy((host, int(port)), args.delay_ms / 1000, args.mbps * 1e6 or None, args.port)
    asyncio.run(_run_forever(proxy))


async def _run_forever(proxy: LatencyProxy) -> None:
    task = asyncio.ensure_future(proxy._serve())
    while not proxy._ready.is_set():
        await asyncio.sleep(0.01)
    print(f"listening 127.0.0.1:{proxy.port}", flush=True)
    seen = (0, 0)
    while not task.done():  # what was forwarded so far, when it changed (a second's resolution)
        await asyncio.sleep(1)
        if (proxy.requests, proxy.connections) != seen:
            seen = (proxy.requests, proxy.connections)
            print(f"requests {seen[0]} connections {seen[1]}", flush=True)
    await task


if __name__ == "__main__":
    main()
