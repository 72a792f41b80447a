"""launcher/http.py's blocking SSE reader, against a real local HTTP server."""

from __future__ import annotations

import http.server
import json
import threading

from sglang_pdd.launcher.http import stream_events


class _Sse(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 — http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["n"]):
            self.wfile.write(f"data: {json.dumps({'output_ids': list(range(i + 1))})}\n\n".encode())
            self.wfile.write(b": keep-alive comment\n\n")
        self.wfile.write(b"data: [DONE]\n\ndata: {\"after\": \"done\"}\n\n")

    def log_message(self, *args):
        pass


def test_yields_each_event_in_order_and_stops_at_done():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/generate"
        events = list(stream_events(url, {"n": 3}, timeout=10))
    finally:
        server.shutdown()
    assert events == [{"output_ids": [0]}, {"output_ids": [0, 1]}, {"output_ids": [0, 1, 2]}]
