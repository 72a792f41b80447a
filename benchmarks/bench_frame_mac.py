"""Micro-benchmark of per-frame authentication schemes for the WAN KV channel (not a timed test).

One run compares, side by side at frame sizes 256 KiB .. 4 MiB, the cost of tagging one
frame's payload with:

* ``hmac-sha256``  stdlib ``hmac`` (what wire.py used up to wire version 3), plus CRC-32
  (``crc32``, the per-chunk checksum it also paid) on its own line;
* ``aes-gcm-enc``  AES-256-GCM encrypting the payload (confidentiality too);
* ``chacha-enc``   ChaCha20-Poly1305 encrypting the payload;
* ``aes-gmac``     AES-256-GCM with an empty plaintext and the payload as associated data
  (a MAC: the tag covers the bytes, nothing is encrypted);
* ``chacha-mac``   ChaCha20-Poly1305 likewise (Poly1305 over the payload);
* ``poly1305``     a standalone Poly1305 (``cryptography``; a real use needs a one-time key
  per frame, e.g. from ChaCha20, as ChaCha20-Poly1305 derives it);
* ``blake2b-key``  keyed BLAKE2b (``hashlib``), 16-byte tag;
* ``gmac-stream``  AES-GCM's incremental interface (``Cipher(..., GCM).encryptor()`` and
  ``authenticate_additional_data`` per 1 MiB piece), what a reader uses when a payload
  arrives in pieces;

against ``memcpy`` (numpy copy of the same bytes) and a plain ``sendall`` of them over a
loopback socket pair (reader ``recv_into`` a preallocated buffer). Each scheme also runs in
``--threads`` threads at once: a ratio near ``threads`` means the GIL is released during
the computation (the channel tags on N stream threads in parallel).

    python -m benchmarks.bench_frame_mac            # ~20 s
    python -m benchmarks.bench_frame_mac --mb 256 --threads 2
    python -m benchmarks.bench_frame_mac --hot   # the same frame again and again (in cache)

``--hot`` tags one frame repeatedly, so it stays in the CPU's caches: if a scheme's rate
does not rise with it, the scheme is compute-bound, and tagging bytes while they are still
hot from the socket copy (smaller frames, MAC per received piece) would not make it cheaper.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import socket
import threading
import time
import zlib

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.poly1305 import Poly1305

KEY = os.urandom(32)
KiB, MiB = 1 << 10, 1 << 20


def schemes():
    gcm, chacha = AESGCM(KEY), ChaCha20Poly1305(KEY)
    out_buf = {}

    def hmac_sha256(frame, i):
        return hmac.new(KEY, frame, "sha256").digest()

    def crc32(frame, i):
        return zlib.crc32(frame)

    def nonce(i):
        return i.to_bytes(12, "big")

    def gcm_enc(frame, i):
        return gcm.encrypt(nonce(i), frame, None)

    def chacha_enc(frame, i):
        return chacha.encrypt(nonce(i), frame, None)

    def gmac(frame, i):
        return gcm.encrypt(nonce(i), b"", frame)

    def chacha_mac(frame, i):
        return chacha.encrypt(nonce(i), b"", frame)

    def poly1305(frame, i):
        return Poly1305.generate_tag(KEY, frame)

    def blake2b_key(frame, i):
        return hashlib.blake2b(frame, key=KEY, digest_size=16).digest()

    def gmac_stream(frame, i):
        enc = Cipher(algorithms.AES(KEY), modes.GCM(nonce(i))).encryptor()
        for off in range(0, len(frame), MiB):
            enc.authenticate_additional_data(frame[off:off + MiB])
        enc.finalize()
        return enc.tag

    def memcpy(frame, i):
        dst = out_buf.get(len(frame))
        if dst is None:
            dst = out_buf[len(frame)] = np.empty(len(frame), np.uint8)
        np.copyto(dst, np.frombuffer(frame, np.uint8))

    return {"memcpy": memcpy, "hmac-sha256": hmac_sha256, "crc32": crc32, "aes-gcm-enc": gcm_enc,
            "chacha-enc": chacha_enc, "aes-gmac": gmac, "chacha-mac": chacha_mac, "poly1305": poly1305, "blake2b-key": blake2b_key,
            "gmac-stream": gmac_stream}


def run_scheme(fn, data: memoryview, frame: int, threads: int, hot: bool = False) -> float:
    """Seconds for ``threads`` threads to each tag all of ``data`` in ``frame``-byte frames
    (``hot``: as many frames, all the first one)."""
    frames = [data[o:o + frame] for o in range(0, len(data) - frame + 1, frame)]
    if hot:
        frames = [frames[0]] * len(frames)

    def work():
        for i, f in enumerate(frames):
            fn(f, i)

    ts = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def plain_sendall(data: memoryview, frame: int) -> float:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * MiB)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MiB)
    buf = memoryview(bytearray(frame))
    n = len(data)

    def recv():
        got = 0
        while got < n:
            r = b.recv_into(buf[(got % frame):], min(frame - got % frame, n - got))
            if r == 0:
                return
            got += r

    t = threading.Thread(target=recv)
    t0 = time.perf_counter()
    t.start()
    for o in range(0, n, frame):
        a.sendall(data[o:o + frame])
    t.join()
    dt = time.perf_counter() - t0
    a.close()
    b.close()
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="bytes tagged per measurement")
    ap.add_argument("--frames-kib", default="256,1024,4096")
    ap.add_argument("--threads", type=int, default=2, help="parallel threads for the GIL check")
    ap.add_argument("--repeats", type=int, default=3, help="best of")
    ap.add_argument("--hot", action="store_true", help="tag the same frame again and again (in cache)")
    ap.add_argument("--schemes", default="", help="comma-separated subset (memcpy is always run)")
    args = ap.parse_args(argv)
    frames_kib = [int(x) for x in args.frames_kib.split(",")]
    if args.mb < 1 or any(f < 1 for f in frames_kib):
        ap.error("--mb and --frames-kib must be positive")
    too_large = [f for f in frames_kib if f * KiB > args.mb * MiB]
    if too_large:  # no whole frame to tag: a rate would be made up
        ap.error(f"--frames-kib {','.join(map(str, too_large))}: a frame larger than the --mb {args.mb} MiB "
                 f"of data; raise --mb or drop those frame sizes")
    data = memoryview(np.random.default_rng(0).integers(0, 256, args.mb * MiB, dtype=np.uint8).tobytes())
    table = schemes()
    if args.schemes:
        keep = {"memcpy", *args.schemes.split(",")}
        table = {k: v for k, v in table.items() if k in keep}
    print(f"{args.mb} MiB per measurement{' (one frame, hot)' if args.hot else ''}, best of {args.repeats}; "
          f"GB/s = 1e9 bytes/s; "
          f"xN = {args.threads} threads' total rate / 1 thread's")
    for frame_kib in frames_kib:
        frame = frame_kib * KiB
        tagged = len(data) // frame * frame  # whole frames only (run_scheme's)
        send = min(plain_sendall(data, frame) for _ in range(args.repeats))
        rates = {"sendall": len(data) / send / 1e9}
        par = {}
        for name, fn in table.items():
            one = min(run_scheme(fn, data, frame, 1, args.hot) for _ in range(args.repeats))
            rates[name] = tagged / one / 1e9
            if args.threads > 1:
                many = min(run_scheme(fn, data, frame, args.threads, args.hot) for _ in range(args.repeats))
                par[name] = (args.threads * tagged / many / 1e9) / rates[name]
        print(f"\nframe {frame_kib} KiB: plain sendall {rates['sendall']:.2f} GB/s, memcpy {rates['memcpy']:.2f} GB/s")
        print(f"  {'scheme':<12} {'GB/s':>7} {'s/GB':>6} {'/memcpy':>8} {'/sendall':>9} {'x' + str(args.threads):>5}")
        for name in table:
            if name == "memcpy":
                continue
            r = rates[name]
            print(f"  {name:<12} {r:7.2f} {1 / r:6.2f} {r / rates['memcpy']:8.2f} {r / rates['sendall']:9.2f} "
                  f"{par.get(name, 1.0):5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
