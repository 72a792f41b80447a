"""Test helper: an authenticated KV stream that writes hand-crafted frames.

After the handshake every frame must carry its MAC tags (wire.FrameMac), so tests that
craft frames by hand send them through ``RawStream.send`` (correctly tagged) and read
replies through ``RawStream.reader`` (which verifies the peer's tags).
"""

import os
import socket
from typing import Optional

from sglang_pdd.kv_channel.handshake import SecureStream, client_handshake
from sglang_pdd.kv_channel.wire import FrameReader, send_frame


class RawStream:
    def __init__(self, addr, key: bytes, name: str = "raw", session_id: Optional[bytes] = None,
                 rcvbuf: Optional[int] = None, stream_index: int = 0, num_streams: int = 1):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect, so the window never grows past it
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(5)
        self.sock.connect(addr)
        self.reader = FrameReader(self.sock)
        self.secure: SecureStream = client_handshake(self.sock, key, name, session_id or os.urandom(16), stream_index,
                                                     num_streams, self.reader)

    def send(self, msg, payload=None) -> None:
        send_frame(self.sock, msg, payload, mac=self.secure.send_mac)

    def tag(self, head: bytes) -> bytes:
        """The header tag of the next frame, for frames built by hand (``head`` = prefix + header)."""
        return self.secure.send_mac.seal(head)[0]

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_message(self):
        return self.reader.read_message()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "RawStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
