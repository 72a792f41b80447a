"""Real control servers on loopback for the control-plane security tests (no SGLang server).

MD: the real ``MdControlServer`` / ``MdControlApi`` over ``FakeMdRuntime``, which keeps the
real room table (DrcRoomTable on a fake tree) and borrows MainDrcRuntime's own wait_ready and
handoff_request; its ``/generate`` (what a handoff relays to) is a tiny stdlib server that
records what it got and streams two SSE events. P: the real ``PrefillControlServer``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sglang_pdd.control.auth import ROLE_P, ControlVerifier
from sglang_pdd.protocol import KvSendersReply, RegisterReply, ReleaseReply
from sglang_pdd.radix_drc.rooms import DrcRoomTable
from sglang_pdd.sglang_glue.md.main_drc import MdControlServer
from sglang_pdd.sglang_glue.md.queries import MdRoomQueries
from sglang_pdd.sglang_glue.p.prefill_control import DestinationBoard, PrefillControlServer

KEY = b"control-plane-test-key-0123456789"
WAN_PEER = ("127.0.0.1", 18000)  # the one MD P may send KV to


class FakeTree:
    def match(self, ids):
        return 0, None

    def lock(self, node):
        return node

    def unlock(self, lock):
        pass

    def ingest(self, ids, prefix_len, prefix_node, staged):
        return None


class FakeGenerate:
    """MD's own SGLang /generate, as a handoff reaches it (loopback); ``ssl_context``: served
    over HTTPS, as SGLang with --ssl-certfile."""

    def __init__(self, ssl_context=None):
        self.requests: list[dict] = []
        self.aborted: list[str] = []  # rids of /abort_request calls
        self.endless = False  # stream an event every 20 ms until the reader goes (or 10 s)
        self.first_event_delay_s = 0.0  # endless: the first event comes this late (an abort ends the wait)
        self.linger_after_done_s = 0.0  # a finite stream: keep the connection this long after [DONE]
        self.abort_arrived = threading.Event()
        self.events_before_abort: list[int] = []  # endless: events written when each abort came
        self.events_written = 0
        self.authorization: list = []  # each /generate's Authorization header (None: none sent)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/abort_request":
                    fake.aborted.append(body.get("rid"))
                    fake.events_before_abort.append(fake.events_written)
                    fake.abort_arrived.set()
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                fake.requests.append(body)
                fake.authorization.append(self.headers.get("Authorization"))
                stream = fake.requests[-1].get("stream", True)
                if stream and fake.endless:
                    return self._stream_endlessly()
                body = (b'data: {"output_ids": [7]}\n\ndata: {"output_ids": [7, 8]}\n\ndata: [DONE]\n\n' if stream
                        else b'{"output_ids": [7, 8]}')
                if stream and fake.linger_after_done_s:  # as SGLang may: the end sent, the close later
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(body)
                    self.wfile.flush()
                    time.sleep(fake.linger_after_done_s)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream" if stream else "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _stream_endlessly(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.flush()
                fake.abort_arrived.wait(fake.first_event_delay_s)
                ids = []
                for token in range(500):
                    ids.append(token)
                    try:
                        self.wfile.write(b"data: " + json.dumps({"output_ids": ids}).encode() + b"\n\n")
                        self.wfile.flush()
                    except OSError:
                        return
                    fake.events_written += 1
                    time.sleep(0.02)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if ssl_context is not None:
            self.httpd.socket = ssl_context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeMdRuntime:
    kv_bytes_per_token = 512  # a tiny model's
    kv_window: dict = {}  # a sliding-window MD's kv_window_tokens and kv_window_bytes_per_token

    def __init__(self, http_port: int, max_rooms: int = 4096):
        self.http_port = http_port
        self.reset(max_rooms)

    def reset(self, max_rooms: int = 4096) -> None:
        self.table = DrcRoomTable(FakeTree(), ttl_s=60.0, max_rooms=max_rooms)
        self.ready_events: dict[int, threading.Event] = {}
        self.counters: dict = {}
        self.queries = MdRoomQueries(self)  # MD's own answers, over this fake's table, events and counters
        self.fail_stats_with = None  # an exception stats() raises (an internal error)
        self.http_api_key = None  # MD's own SGLang --api-key
        self.http_ssl_certfile = None  # MD's own SGLang --ssl-certfile (then it serves HTTPS)
        self.kv_senders: list = []  # each announcement of P hosts, as the receiver got it

    def register(self, req):
        entry = self.table.register(req.room, req.token_ids, time.monotonic(), use_cache=req.use_cache)
        self.ready_events[req.room] = threading.Event()
        return RegisterReply(req.room, entry.cached_len, prompt_tokens=len(req.token_ids))

    def announce_kv_senders(self, req):
        self.kv_senders.append(list(req.sources))
        return KvSendersReply(len(req.sources))

    def release(self, req):
        self.ready_events.pop(req.room, None)
        return ReleaseReply(self.table.release(req.room))

    def wait_ready(self, req):
        return self.queries.wait_ready(req)

    def handoff_request(self, room: int, req):
        return self.queries.handoff_request(room, req)

    def mark_ready(self, room: int) -> None:
        self.table.complete(room, None, time.monotonic())
        self.ready_events[room].set()

    def stats(self) -> dict:
        if self.fail_stats_with is not None:
            raise self.fail_stats_with
        return {"open_rooms": len(self.table.rooms), "kv_bytes_per_token": self.kv_bytes_per_token, **self.kv_window}

    def state(self):
        """Everything a control call can change."""
        return {r: (e.status, e.token_ids, e.handed_off) for r, e in self.table.rooms.items()}


def _scheme(server_kw: dict) -> str:
    return "https" if server_kw.get("ssl_context") is not None else "http"


class MdControl:
    """``server_kw``: MdControlServer's, e.g. ``ssl_context`` (then ``url`` is https);
    ``generate_tls``: MD's own /generate served over HTTPS with this context."""

    def __init__(self, max_rooms: int = 4096, max_connections: int = 1024, generate_tls=None, **server_kw):
        self.generate = FakeGenerate(generate_tls)
        self.runtime = FakeMdRuntime(self.generate.port, max_rooms=max_rooms)
        self.server = MdControlServer(("127.0.0.1", 0), self.runtime, key=KEY, max_connections=max_connections,
                                    **server_kw)
        self.url = f"{_scheme(server_kw)}://%s:%s" % self.server.address

    def reset(self):
        self.runtime.reset()
        self.generate.requests.clear()
        self.generate.authorization.clear()

    def close(self):
        self.server.close()
        self.generate.close()


class PControl:
    """P's control API; ``port``/``tp_*``/``sends_wan``/``ssl_context``: one TP rank's
    (PrefillControlServer's)."""

    def __init__(self, port: int = 0, **tp):
        self.board = DestinationBoard()
        self.server = PrefillControlServer(self.board, "127.0.0.1", port, auth=ControlVerifier(KEY, role=ROLE_P),
                                           peer_allowed=lambda peer: peer == WAN_PEER, **tp)
        self.url = f"{_scheme(tp)}://%s:%s" % self.server.address

    def close(self):
        self.server.close()


def exchange_raw(host: str, port: int, request: bytes, timeout: float = 10.0, finish_body: bool = True,
                 source: str = None) -> bytes:
    """Send bytes as they are (no client fixes the headers up) and read the answer until the
    server closes. ``finish_body``: shut our side after sending, so a body shorter than its
    Content-Length ends there rather than at the server's read timeout; without it the
    connection stays open for writing (a client still to send its body). ``source``: the
    local address to send from (another 127.0.0.x: another host, as the server counts)."""
    with socket.create_connection((host, port), timeout=timeout,
                                  source_address=(source, 0) if source else None) as s:
        try:
            s.sendall(request)
            if finish_body:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered and closed before reading it all (e.g. 503 busy)
            pass
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    return data
