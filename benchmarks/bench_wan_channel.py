"""Benchmark of the WAN KV channel (not a timed test).

1. Emulated WAN: move one request's KV (several sizes) through ``WanEmulator`` at several
   link rates, with latency and jitter; report achieved throughput as a fraction of the
   configured link rate (goal >= 0.9). Time runs from ``begin_transfer`` to the
   receiver's ACK, so it includes the fixed cost of one-way latency + the ACK's return.
2. Loopback, same run: the channel vs. a plain ``socket.sendall`` of the same bytes
   (one TCP connection, receiver ``recv_into`` a preallocated buffer), and Mooncake
   TransferEngine in TCP mode (``transfer_sync_write`` between two engines) if
   ``mooncake.engine`` is importable, and sglang-pdd's ``TcpTransferEngine`` (the intra-DC
   fallback) doing the same writes: once as one write, once as a batch of 64 KiB pages (the
   shape SGLang's Mooncake manager gives an engine).

    python -m benchmarks.bench_wan_channel            # full run (~1-2 min)
    python -m benchmarks.bench_wan_channel --quick    # smaller sizes

3. ``--side-by-side``: only the loopback comparison that the line-rate goal is stated in:
   the channel (``--streams`` streams) vs. plain ``sendall`` over the *same number* of TCP
   connections (each moves 1/N of the bytes into a preallocated buffer), with and without
   mutual TLS (test certificates made with the openssl CLI), best of ``--repeats``
   interleaved runs, for ``--loopback-sizes-mb`` (``--tls off|mutual|both``). Also "sendall
   warm" (the same on connections kept open, as the channel's are) and, without TLS,
   "sendall+GMAC": plain sendall plus the AES-GMAC of every frame on both sides and nothing
   else, the ceiling of any channel with per-frame MACs on the machine at hand; "channel tags
   off" (diagnostic: the frame MACs patched out in this process, to split the channel's cost
   into MAC and the rest); "vmsplice+GMAC" (prototype: a zero-copy sender). Besides the best wall-clock rate
   it prints the CPU seconds per GB (user + system, both ends, median run): on a host whose
   cores are busy with other work, wall-clock ratios swing with the neighbours, while the
   CPU ratio is what the throughput ratio becomes once the transfer is CPU-bound::

    python -m benchmarks.bench_wan_channel --side-by-side --loopback-sizes-mb 64 --repeats 7
    python -m benchmarks.bench_wan_channel --side-by-side --loopback-sizes-mb 1024 --tls off

Prints a table and writes ``results.json`` and ``bench_wan.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import socket
import sys
import threading
import time

import numpy as np
from tqdm import tqdm

from sglang_pdd.kv_channel.layout import KvLayout
from sglang_pdd.kv_channel.contract import RoomState
from sglang_pdd.launcher.wan_emulator import WanEmulator
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wan_sender import WanKvSender

KEY = b"bench-shared-key-0123456789abcdef"
MB = 1 << 20
PAGE_BYTES = 64 * 1024  # one page of one layer (e.g. 16 tokens x 8 kv heads x 128 x bf16 x K+V)


def make_kv(size_bytes: int, num_layers: int = 32):
    """(layout, KV, tokens) of ``size_bytes`` rounded down to whole pages (no more: the engines
    register ``size_bytes``): ``num_layers`` layers, fewer below one page per layer."""
    if size_bytes < PAGE_BYTES:
        raise ValueError(f"a KV size of {size_bytes} B is below one {PAGE_BYTES} B page")
    num_layers = min(num_layers, size_bytes // PAGE_BYTES)
    pages = size_bytes // (num_layers * PAGE_BYTES)
    layout = KvLayout(num_layers, 16, PAGE_BYTES, "bfloat16")
    kv = np.random.default_rng(0).integers(0, 256, (num_layers, pages, PAGE_BYTES), dtype=np.uint8)
    return layout, kv, pages * 16


class Channel:
    """One receiver (+ optional emulator) and one sender, reused across transfers."""

    def __init__(self, streams: int, emu_kw: dict | None, tls: tuple | None = None):
        server_ctx, client_ctx = tls or (None, None)
        self.rx = WanKvReceiver(KEY, name="bench-md", idle_timeout=30, ssl_context=server_ctx)
        self.emu = WanEmulator(self.rx.address, **emu_kw).start() if emu_kw is not None else None
        target = self.emu.address if self.emu else self.rx.address
        self.tx = WanKvSender(target, KEY, name="bench-p", num_streams=streams, idle_timeout=30,
                              transfer_timeout=600, ssl_context=client_ctx)
        assert self.tx.connect(10), "could not connect"
        self.room = 0

    def transfer(self, layout, kv, num_tokens, dest) -> tuple[float, int]:
        self.room += 1
        self.rx.register_room(self.room, layout, num_tokens, dest)
        wire0 = self.emu.stats()["bytes_up"] if self.emu else 0
        c0, t0 = _cpu_seconds(), time.perf_counter()
        xfer = self.tx.begin_transfer(self.room, layout, num_tokens, 0)
        xfer.send_kv(kv)
        state = xfer.wait(600)
        elapsed = time.perf_counter() - t0
        self.last_cpu = _cpu_seconds() - c0
        if state != RoomState.SUCCESS:
            raise RuntimeError(f"transfer failed: {xfer.failure_reason} {xfer.failure_detail}")
        wire = (self.emu.stats()["bytes_up"] - wire0) if self.emu else xfer.plan.total_bytes
        self.rx.release_room(self.room)
        self.tx.release(self.room)
        return elapsed, wire

    def close(self):
        self.tx.close()
        if self.emu:
            self.emu.stop()
        self.rx.close()


def plain_sendall(data: np.ndarray, dest: np.ndarray) -> float:
    """Baseline: one TCP connection, sendall / recv_into, same bytes."""
    server = socket.create_server(("127.0.0.1", 0))
    view = memoryview(dest).cast("B")
    done = threading.Event()

    def recv():
        conn, _ = server.accept()
        with conn:
            got = 0
            while got < len(view):
                got += conn.recv_into(view[got:]) or 0
        done.set()

    threading.Thread(target=recv, daemon=True).start()
    with socket.create_connection(server.getsockname()[:2]) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(memoryview(data).cast("B"))
        done.wait()
        elapsed = time.perf_counter() - t0
    server.close()
    return elapsed


def _connect_streams(streams: int, tls: tuple | None) -> tuple:
    """``streams`` loopback TCP connections (TLS-wrapped if ``tls`` = (server, client)
    contexts), tuned like the channel's: (listening socket, receiving ends, sending ends)."""
    from sglang_pdd.kv_channel.wan_sender import tune_socket

    server = socket.create_server(("127.0.0.1", 0), backlog=streams)
    conns, clients = [], []
    for _ in range(streams):  # connect (and TLS handshake) outside the timing
        c = socket.create_connection(server.getsockname()[:2])
        a, _ = server.accept()
        tune_socket(c)
        tune_socket(a)
        if tls:
            hs = threading.Thread(target=lambda: conns.append(tls[0].wrap_socket(a, server_side=True)))
            hs.start()
            c = tls[1].wrap_socket(c, server_hostname="127.0.0.1")
            hs.join()
        else:
            conns.append(a)
        clients.append(c)
    return server, conns, clients


def _vmsplice_sender():
    """A ``send(sock, data_array, lo, hi)`` that hands the pages of ``data_array[lo:hi]`` to
    the socket without copying them (vmsplice into a pipe, splice to the socket), or None
    where the C library has no vmsplice. Prototype only: the kernel keeps referencing the
    caller's pages after the call returns (no completion is reported), so the buffer must
    not change until the receiver has read it."""
    import ctypes
    import fcntl

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        vmsplice = libc.vmsplice
    except (OSError, AttributeError):
        return None

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    vmsplice.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.c_uint]
    vmsplice.restype = ctypes.c_ssize_t
    pipe_bytes = 1 << 20  # the default /proc/sys/fs/pipe-max-size
    pipes = threading.local()

    def send(sock, data: np.ndarray, lo: int, hi: int) -> None:
        if not hasattr(pipes, "fds"):
            pipes.fds = os.pipe()
            fcntl.fcntl(pipes.fds[1], 1031, pipe_bytes)  # F_SETPIPE_SZ
        r, w = pipes.fds
        iov, base = IoVec(), data.ctypes.data
        while lo < hi:
            iov.base, iov.len = base + lo, min(hi - lo, pipe_bytes)
            n = vmsplice(w, ctypes.byref(iov), 1, 0)
            if n < 0:
                raise OSError(ctypes.get_errno(), "vmsplice")
            left = n
            while left:
                left -= os.splice(r, sock.fileno(), left, flags=os.SPLICE_F_MOVE)
            lo += n

    return send


def _move(conns, clients, data: np.ndarray, dest: np.ndarray, mac_piece: int = 0, zero_copy=None) -> tuple:
    """Each connection moves 1/N of ``data`` into ``dest`` (``recv_into`` a preallocated
    buffer). Returns (seconds from the first send to the last byte received, CPU seconds of
    the process meanwhile).

    ``mac_piece`` > 0: plus what any per-frame MAC costs and nothing else: each side computes
    an AES-GMAC tag (the channel's primitive) of every ``mac_piece`` bytes, the sender before
    sending them, the receiver once they are in; tags are not sent. ``zero_copy``: a sender
    from ``_vmsplice_sender`` instead of ``sendall``."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    streams = len(conns)
    src, dst = memoryview(data).cast("B"), memoryview(dest).cast("B")
    n = len(src)
    bounds = [(i * n // streams, (i + 1) * n // streams) for i in range(streams)]
    gmac = AESGCM(bytes(32))

    def recv(conn, lo, hi):
        view = dst[lo:hi]
        got = tagged = 0
        while got < len(view):
            r = conn.recv_into(view[got:])
            if not r:
                raise ConnectionError("closed early")
            got += r
            while mac_piece and (got - tagged >= mac_piece or (got == len(view) and tagged < got)):
                end = min(tagged + mac_piece, got)
                gmac.encrypt(bytes(12), b"", view[tagged:end])
                tagged = end

    def send(c, lo, hi):
        step = mac_piece or (hi - lo)
        for o in range(lo, hi, step):
            e = min(o + step, hi)
            if mac_piece:
                gmac.encrypt(bytes(12), b"", src[o:e])
            if zero_copy is not None:
                zero_copy(c, data, o, e)
            else:
                c.sendall(src[o:e])

    threads = [threading.Thread(target=recv, args=(conns[i], *bounds[i])) for i in range(streams)]
    threads += [threading.Thread(target=send, args=(clients[i], *bounds[i])) for i in range(streams)]
    c0, t0 = _cpu_seconds(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, _cpu_seconds() - c0


def plain_sendall_streams(data: np.ndarray, dest: np.ndarray, streams: int, tls: tuple | None = None,
                          mac_piece: int = 0, zero_copy=None) -> tuple[float, float]:
    """Baseline of the same shape as the channel: ``streams`` new TCP connections (TLS-wrapped
    if ``tls`` = (server, client) contexts), each ``sendall``s 1/N of the bytes, the receiver
    ``recv_into``s them into ``dest`` (see ``_move`` for ``mac_piece`` and ``zero_copy``).
    Returns (seconds, CPU seconds); connecting is not counted."""
    server, conns, clients = _connect_streams(streams, tls)
    try:
        return _move(conns, clients, data, dest, mac_piece, zero_copy)
    finally:
        for s in conns + clients:
            s.close()
        server.close()


class WarmSendall:
    """The same baseline on connections kept open across runs, as the channel keeps its."""

    def __init__(self, streams: int, tls: tuple | None = None):
        self.server, self.conns, self.clients = _connect_streams(streams, tls)

    def run(self, data: np.ndarray, dest: np.ndarray) -> tuple[float, float]:
        return _move(self.conns, self.clients, data, dest)

    def close(self):
        for s in self.conns + self.clients:
            s.close()
        self.server.close()


class _FrameTagsOff:
    """Diagnostic only: while active, every frame tag in this process is a constant and no
    payload is tagged, on both ends (the benchmark runs both), so the channel's run shows
    its cost without the MAC. Never a mode of the channel itself."""

    def __enter__(self):
        from sglang_pdd.kv_channel import wire

        def begin(mac, head, payload_len=0):
            mac.seq += 1
            return bytes(wire.TAG_BYTES), None

        self._wire, self._begin = wire, wire.FrameMac.begin
        wire.FrameMac.begin = begin

    def __exit__(self, *exc):
        self._wire.FrameMac.begin = self._begin


def tls_contexts(d: str) -> tuple:
    """(server, client) mutual-TLS contexts from throwaway certificates made in ``d``."""
    import subprocess

    from sglang_pdd.kv_channel.tls import client_context, server_context

    def ossl(*a):
        subprocess.run(["openssl", *a], check=True, capture_output=True, cwd=d)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ossl("req", "-x509", *ec, "-days", "1", "-subj", "/CN=ca", "-keyout", "ca.key", "-out", "ca.pem")
    for name, san in (("md", "IP:127.0.0.1"), ("p", "DNS:prefill")):
        ossl("req", "-new", *ec, "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(f"subjectAltName={san}\n")
        ossl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days",
             "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
        os.chmod(os.path.join(d, f"{name}.key"), 0o600)
    j = lambda f: os.path.join(d, f)  # noqa: E731
    return (server_context(j("md.pem"), j("md.key"), j("ca.pem")),
            client_context(j("p.pem"), j("p.key"), j("ca.pem")))


def _cpu_seconds() -> float:
    """User + system CPU of this process (both ends of the loopback run in it)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def side_by_side(sizes: list[int], streams: int, repeats: int, out: str, tls_modes=("off", "mutual")) -> list[dict]:
    """Channel vs plain N-stream sendall on loopback, without and with mutual TLS.

    Rows besides the channel and ``sendall`` (new connections per run, the reference of the
    ratios): ``sendall warm`` (connections kept open, as the channel's are), and without TLS
    ``sendall+GMAC`` (the ceiling of any channel with per-frame MACs here), ``channel tags
    off`` (diagnostic: the channel with its frame MACs patched out, so channel minus this
    row is the MAC's cost and this row minus sendall the channel's own) and
    ``vmsplice+GMAC`` (prototype: sendall+GMAC whose sender hands its pages to the socket
    instead of copying them)."""
    import tempfile

    zero_copy = _vmsplice_sender()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for tls_name in tls_modes:
            tls = tls_contexts(d) if tls_name != "off" else None
            ch = Channel(streams, None, tls)
            warm = WarmSendall(streams, tls)
            try:
                for size in sizes:
                    layout, kv, ntok = make_kv(size)
                    dest = np.zeros_like(kv)
                    ch.transfer(layout, kv, ntok, dest)  # warm-up (page faults in dest)
                    assert np.array_equal(dest, kv)
                    piece = min(ch.tx.max_chunk_bytes, kv.nbytes // layout.num_layers)  # the channel's frames

                    def channel():
                        return ch.transfer(layout, kv, ntok, dest)[0], ch.last_cpu

                    def channel_tags_off():
                        with _FrameTagsOff():
                            return channel()

                    runs = {"channel": channel,
                            "sendall": lambda: plain_sendall_streams(kv, dest, streams, tls),
                            "sendall warm": lambda: warm.run(kv, dest)}
                    if tls is None:
                        runs["sendall+GMAC"] = lambda: plain_sendall_streams(kv, dest, streams, None, piece)
                        runs["channel tags off"] = channel_tags_off
                        if zero_copy is not None:
                            runs["vmsplice+GMAC"] = lambda: plain_sendall_streams(kv, dest, streams, None, piece,
                                                                                  zero_copy)
                    for run in runs.values():  # warm-up of each, then interleaved runs
                        run()
                    wall = {k: [] for k in runs}
                    cpu = {k: [] for k in runs}
                    for _ in range(repeats):  # interleaved: a noisy neighbour hits all alike
                        for name, run in runs.items():
                            w, c = run()
                            wall[name].append(w)
                            cpu[name].append(c)
                    assert np.array_equal(dest, kv)
                    best = {k: min(v) for k, v in wall.items()}
                    cpu_med = {k: float(np.median(v)) for k, v in cpu.items()}
                    row = dict(tls=tls_name, kv_bytes=kv.nbytes, streams=streams, frame_bytes=piece,
                               load_avg=os.getloadavg()[0],
                               **{f"{k}_gbps": gbps(kv.nbytes, v) for k, v in best.items()},
                               **{f"{k}_cpu_s_per_gb": v / kv.nbytes * 1e9 for k, v in cpu_med.items()},
                               **{f"{k}_ratio": best["sendall"] / v for k, v in best.items()},
                               **{f"{k}_cpu_ratio": cpu_med["sendall"] / v for k, v in cpu_med.items()},
                               ratio=best["sendall"] / best["channel"],
                               cpu_ratio=cpu_med["sendall"] / cpu_med["channel"], wall_s=wall, cpu_s=cpu)
                    print(f"  TLS {tls_name:<6} {kv.nbytes / MB:>6.0f} MiB, {piece / MB:g} MiB frames, "
                          f"load {row['load_avg']:.1f}", flush=True)
                    for k in runs:
                        print(f"    {k:<17} {gbps(kv.nbytes, best[k]):6.2f} Gbit/s  ratio {row[f'{k}_ratio']:.2f}"
                              f"   CPU {row[f'{k}_cpu_s_per_gb']:.3f} s/GB  ratio {row[f'{k}_cpu_ratio']:.2f}",
                              flush=True)
                    rows.append(row)
            finally:
                ch.close()
                warm.close()
    with open(os.path.join(out, "side_by_side.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


# Writes per engine call: Mooncake's TCP transport rejects much larger batches (lane queue
# full), and SGLang caps them too (SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES).
BATCH_ENTRIES = 128


def batches(src: np.ndarray, dst: np.ndarray, nbytes: int, piece: int = 0):
    """(srcs, dsts, lens) of nbytes cut into ``piece``-byte writes, BATCH_ENTRIES per call."""
    piece = piece or nbytes
    offs = list(range(0, nbytes, piece))
    for i in range(0, len(offs), BATCH_ENTRIES):
        part = offs[i:i + BATCH_ENTRIES]
        yield ([src.ctypes.data + o for o in part], [dst.ctypes.data + o for o in part],
               [min(piece, nbytes - o) for o in part])


class Mooncake:
    """Two Mooncake TransferEngines (TCP protocol, P2P handshake) in this process."""

    def __init__(self, nbytes: int):
        from mooncake.engine import TransferEngine

        self.a, self.b = TransferEngine(), TransferEngine()
        for eng in (self.a, self.b):
            if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("mooncake initialize failed")
        self.src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, np.uint8)
        assert self.a.register_memory(self.src.ctypes.data, nbytes) == 0
        assert self.b.register_memory(self.dst.ctypes.data, nbytes) == 0
        self.target = f"127.0.0.1:{self.b.get_rpc_port()}"
        self.write(1 << 20)  # warm-up: opens the segment (handshake) outside the timing

    def write(self, nbytes: int, piece: int = 0) -> float:
        t0 = time.perf_counter()
        for srcs, dsts, lens in batches(self.src, self.dst, nbytes, piece):
            rc = self.a.batch_transfer_sync_write(self.target, srcs, dsts, lens)
            if rc != 0:
                raise RuntimeError(f"mooncake batch_transfer_sync_write returned {rc}")
        return time.perf_counter() - t0


class PddTcpEngine:
    """Two TcpTransferEngines (the intra-DC fallback) in this process, same writes as Mooncake."""

    def __init__(self, nbytes: int):
        from sglang_pdd.kv_channel.tcp_engine import TcpTransferEngine

        self.a, self.b = TcpTransferEngine("127.0.0.1", KEY, name="a"), TcpTransferEngine("127.0.0.1", KEY, name="b")
        self.src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, np.uint8)
        assert self.a.batch_register([self.src.ctypes.data], [nbytes]) == 0
        assert self.b.batch_register([self.dst.ctypes.data], [nbytes]) == 0
        self.target = self.b.get_session_id()
        self.write(1 << 20)  # warm-up: connect + authenticate outside the timing

    def write(self, nbytes: int, piece: int = 0) -> float:
        t0 = time.perf_counter()
        for srcs, dsts, lens in batches(self.src, self.dst, nbytes, piece):
            rc = self.a.batch_transfer_sync(self.target, srcs, dsts, lens)
            if rc != 0:
                raise RuntimeError(f"TcpTransferEngine batch_transfer_sync returned {rc}")
        return time.perf_counter() - t0

    def close(self):
        self.a.close()
        self.b.close()


def gbps(nbytes, seconds):
    return nbytes * 8 / seconds / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates-gbps", default="0.1,0.5,1,2", help="emulated link rates")
    ap.add_argument("--sizes-mb", default="16,64,256", help="KV bytes per request")
    ap.add_argument("--loopback-sizes-mb", default="64,256")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="one-way")
    ap.add_argument("--jitter-ms", type=float, default=1.0)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="loopback repeats (median reported)")
    ap.add_argument("--max-case-seconds", type=float, default=12.0, help="skip cases expected to take longer")
    ap.add_argument("--quick", action="store_true", help="sizes 16,64 MB, rates 0.1,0.5,1")
    ap.add_argument("--out", default="artifacts/bench_wan")
    ap.add_argument("--side-by-side", action="store_true",
                    help="only: channel vs plain sendall, same stream count, TLS off and on (best of --repeats)")
    ap.add_argument("--tls", choices=("off", "mutual", "both"), default="both", help="with --side-by-side")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.side_by_side:
        os.makedirs(args.out, exist_ok=True)
        print(f"loopback, {args.streams} streams each side, {args.repeats} interleaved runs; Gbit/s: best run; "
              f"CPU s/GB: median run, both ends; ratios: the row's rate / sendall's, sendall's CPU / the row's")
        side_by_side([int(s) * MB for s in args.loopback_sizes_mb.split(",")], args.streams, args.repeats, args.out,
                     ("off", "mutual") if args.tls == "both" else (args.tls,))
        return 0
    if args.quick:
        args.rates_gbps, args.sizes_mb, args.loopback_sizes_mb = "0.1,0.5,1", "16,64", "64"
    rates = [float(r) for r in args.rates_gbps.split(",")]
    sizes = [int(s) * MB for s in args.sizes_mb.split(",")]
    lsizes = [int(s) * MB for s in args.loopback_sizes_mb.split(",")]
    os.makedirs(args.out, exist_ok=True)

    wan_rows, loop_rows = [], []
    cases = [(r, s) for r in rates for s in sizes if s * 8 / (r * 1e9) <= args.max_case_seconds]
    skipped = [(r, s) for r in rates for s in sizes if (r, s) not in cases]

    # ---- 1. emulated WAN
    bar = tqdm(total=len(cases) + len(lsizes), desc="bench", unit="case")
    for rate in rates:
        rate_cases = [s for r, s in cases if r == rate]
        if not rate_cases:
            continue
        ch = Channel(args.streams, dict(rate_gbps=rate, latency_ms=args.latency_ms, jitter_ms=args.jitter_ms))
        try:
            for size in rate_cases:
                layout, kv, ntok = make_kv(size)
                dest = np.zeros_like(kv)
                secs, wire = ch.transfer(layout, kv, ntok, dest)
                assert np.array_equal(dest, kv)
                g = gbps(kv.nbytes, secs)
                wan_rows.append(dict(rate_gbps=rate, kv_bytes=kv.nbytes, wire_bytes=wire, seconds=secs,
                                     gbps=g, fraction=g / rate))
                bar.update()
        finally:
            ch.close()

    # ---- 2. loopback: channel vs plain sendall vs mooncake
    try:
        mooncake = Mooncake(max(lsizes))
        mooncake_note = "mooncake TransferEngine (tcp)"
    except ImportError:
        mooncake, mooncake_note = None, "mooncake not installed, skipped"
    except Exception as e:  # noqa: BLE001
        mooncake, mooncake_note = None, f"mooncake unavailable ({e!r}), skipped"
    tcp_engine = PddTcpEngine(max(lsizes))
    ch = Channel(args.streams, None)
    try:
        for size in lsizes:
            layout, kv, ntok = make_kv(size)
            dest = np.zeros_like(kv)
            ch.transfer(layout, kv, ntok, dest)  # warm-up (page faults in dest)
            # Median of --repeats, interleaved, so a noisy neighbour hits all three alike.
            secs_ch, secs_plain, secs_mc, secs_mc_pg, secs_te, secs_te_pg = [], [], [], [], [], []
            for _ in range(args.repeats):
                secs_ch.append(ch.transfer(layout, kv, ntok, dest)[0])
                secs_plain.append(plain_sendall(kv, dest))
                secs_te.append(tcp_engine.write(kv.nbytes))
                secs_te_pg.append(tcp_engine.write(kv.nbytes, PAGE_BYTES))
                if mooncake is not None:
                    secs_mc.append(mooncake.write(kv.nbytes))
                    secs_mc_pg.append(mooncake.write(kv.nbytes, PAGE_BYTES))
            assert np.array_equal(tcp_engine.dst[:kv.nbytes], tcp_engine.src[:kv.nbytes])
            secs_ch, secs_plain = float(np.median(secs_ch)), float(np.median(secs_plain))
            row = dict(kv_bytes=kv.nbytes, channel_s=secs_ch, channel_gbps=gbps(kv.nbytes, secs_ch),
                       sendall_s=secs_plain, sendall_gbps=gbps(kv.nbytes, secs_plain),
                       tcp_engine_gbps=gbps(kv.nbytes, float(np.median(secs_te))),
                       tcp_engine_paged_gbps=gbps(kv.nbytes, float(np.median(secs_te_pg))))
            row["channel_vs_sendall"] = row["channel_gbps"] / row["sendall_gbps"]
            if mooncake is not None:
                secs_mc = float(np.median(secs_mc))
                row.update(mooncake_s=secs_mc, mooncake_gbps=gbps(kv.nbytes, secs_mc),
                           mooncake_paged_gbps=gbps(kv.nbytes, float(np.median(secs_mc_pg))))
            loop_rows.append(row)
            bar.update()
    finally:
        ch.close()
        tcp_engine.close()
        bar.close()

    # ---- report
    print(f"\nEmulated WAN: latency {args.latency_ms} ms one-way, jitter {args.jitter_ms} ms, "
          f"{args.streams} streams, 32 layers x 64 KiB pages (fewer layers below 2 MiB)")
    print(f"{'link Gbps':>9} {'KV MiB':>7} {'wire bytes':>12} {'seconds':>8} {'Gbps':>7} {'frac':>6}")
    for r in wan_rows:
        print(f"{r['rate_gbps']:>9g} {r['kv_bytes'] / MB:>7.0f} {r['wire_bytes']:>12d} {r['seconds']:>8.3f} "
              f"{r['gbps']:>7.3f} {r['fraction']:>6.3f}")
    for r, s in skipped:
        print(f"{r:>9g} {s / MB:>7.0f}  skipped (> {args.max_case_seconds:g} s expected)")
    print(f"\nLoopback, same run ({mooncake_note}):")
    print(f"{'KV MiB':>7} {'channel Gbps':>12} {'sendall Gbps':>12} {'ratio':>6} {'mooncake Gbps':>13} "
          f"{'tcp-engine Gbps':>15}   (64 KiB pages: mooncake / tcp-engine)")
    for r in loop_rows:
        mc = f"{r['mooncake_gbps']:>13.3f}" if "mooncake_gbps" in r else f"{'skipped':>13}"
        mc_pg = f"{r['mooncake_paged_gbps']:.3f}" if "mooncake_paged_gbps" in r else "skipped"
        print(f"{r['kv_bytes'] / MB:>7.0f} {r['channel_gbps']:>12.3f} {r['sendall_gbps']:>12.3f} "
              f"{r['channel_vs_sendall']:>6.2f} {mc} {r['tcp_engine_gbps']:>15.3f}   "
              f"{mc_pg} / {r['tcp_engine_paged_gbps']:.3f}")

    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(args=vars(args), wan=wan_rows, loopback=loop_rows, mooncake=mooncake_note), f, indent=1)
    plot(wan_rows, loop_rows, os.path.join(args.out, "bench_wan.png"))
    print(f"\nwrote {args.out}/results.json and {args.out}/bench_wan.png")
    return 0


def plot(wan_rows, loop_rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for size in sorted({r["kv_bytes"] for r in wan_rows}):
        rows = [r for r in wan_rows if r["kv_bytes"] == size]
        ax1.plot([r["rate_gbps"] for r in rows], [r["fraction"] for r in rows], "o-", label=f"{size / MB:.0f} MiB")
    ax1.axhline(0.9, color="gray", ls="--", lw=1, label="goal 0.9")
    ax1.set(xscale="log", xlabel="emulated link rate (Gbps)", ylabel="achieved / link rate", ylim=(0, 1.05),
            title="WAN channel over the emulated link")
    ax1.legend(fontsize=8)
    labels = [f"{r['kv_bytes'] / MB:.0f} MiB" for r in loop_rows]
    x = np.arange(len(loop_rows))
    series = [("sendall", "sendall_gbps"), ("WAN channel", "channel_gbps"), ("Mooncake TCP", "mooncake_gbps"),
              ("TCP engine", "tcp_engine_gbps"), ("Mooncake TCP, 64 KiB pages", "mooncake_paged_gbps"),
              ("TCP engine, 64 KiB pages", "tcp_engine_paged_gbps")]
    series = [(n, k) for n, k in series if all(k in r for r in loop_rows)]
    w = 0.8 / max(1, len(series))
    for i, (name, key) in enumerate(series):
        ax2.bar(x + i * w, [r[key] for r in loop_rows], w, label=name)
    ax2.set(xticks=x + w * (len(series) - 1) / 2, xticklabels=labels, ylabel="Gbps", title="loopback")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
