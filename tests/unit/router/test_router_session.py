"""The router's client session retires idle keep-alive connections before SGLang's server does."""

import asyncio

from sglang_pdd.router.front.app import BACKEND_KEEPALIVE_S, backend_session


def test_idle_connections_are_not_reused_after_the_keepalive():
    async def run():
        connections = []

        async def handle(reader, writer):
            connections.append(writer)
            try:
                while True:
                    line = await reader.readline()
                    if not line:
                        return
                    while (await reader.readline()) not in (b"\r\n", b""):
                        pass
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}")
                    await writer.drain()
            except ConnectionError:
                pass

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = "http://127.0.0.1:%d/" % server.sockets[0].getsockname()[1]
        session = backend_session(keepalive_s=0.2)
        try:
            for _ in range(2):  # back to back: one connection, reused
                async with session.get(url) as r:
                    await r.read()
            assert len(connections) == 1
            await asyncio.sleep(0.5)  # idle past the keepalive: the next request opens a new one
            async with session.get(url) as r:
                await r.read()
            assert len(connections) == 2
        finally:
            await session.close()
            server.close()

    asyncio.run(run())


def test_keepalive_is_below_sglangs_server_timeout():
    assert BACKEND_KEEPALIVE_S < 5  # SGLANG_TIMEOUT_KEEP_ALIVE's default
