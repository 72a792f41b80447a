"""The JSON side of the small stdlib HTTP control APIs: MD's rooms and P's WAN destinations
(inside SGLang scheduler processes, which have no event loop of ours) and the WAN emulator's."""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler

logger = logging.getLogger(__name__)


class JsonRequestHandler(BaseHTTPRequestHandler):
    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args):  # access logs at debug level: the server log stays readable
        logger.debug("control %s " + fmt, self.client_address[0], *args)
