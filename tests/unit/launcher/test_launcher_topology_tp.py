"""The launcher's P with ``--tp N``: its argv, its cores per rank, its N control ports (pure)."""

from __future__ import annotations

import socket

import pytest

from sglang_pdd.launcher.topology import (LOOPBACK, ServerSpec, Topology, free_port, omp_threads_bind,
                                          router_argv, server_argv, server_env)


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_each_server_gets_its_own_tp_once():
    topo = Topology.on_free_ports(prefill_tp=2)
    assert flag_values(server_argv(topo.prefill, "/m", "/k"), "--tp") == ["2"]
    assert flag_values(server_argv(topo.relay, "/m", "/k"), "--tp") == ["1"]
    assert flag_values(server_argv(topo.main, "/m", "/k"), "--tp") == ["1"]
    # P's control API is still given as one address: rank r adds r to its port itself
    assert flag_values(server_argv(topo.prefill, "/m", "/k"), "--pdd-control-listen") == [
        f"{LOOPBACK}:{topo.prefill.control_port}"]
    prefill_arg = flag_values(router_argv(topo, "/m"), "--prefill")[0]
    assert prefill_arg.endswith(f",http://{LOOPBACK}:{topo.prefill.control_port}")


def test_only_a_multi_rank_server_binds_cores_per_rank():
    topo = Topology.on_free_ports(prefill_tp=2)
    assert server_env(topo.prefill, cores=[0, 1])["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    assert server_env(topo.prefill)["SGLANG_PLUGINS"] == "pdd"  # CPU_ENV kept
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in server_env(topo.relay)
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in server_env(ServerSpec("single", None, 1))


@pytest.mark.parametrize("tp,cores,expected", [
    (2, [0, 1], "0|1"),
    (2, [1, 0], "0|1"),
    (2, list(range(8)), "0-3|4-7"),
    (3, list(range(8)), "0-2|3-5|6-7"),
    (2, [0, 2, 4, 6], "0,2|4,6"),
    (1, [0, 1, 2], "0-2"),
    (4, [0, 1], "0|1|0|1"),  # more ranks than cores: they share
])
def test_cores_split_into_one_group_per_rank(tp, cores, expected):
    assert omp_threads_bind(tp, cores) == expected


def test_p_control_port_is_the_first_of_tp_consecutive_free_ports():
    topo = Topology.on_free_ports(prefill_tp=3)
    ranks = [topo.prefill.control_port + r for r in range(3)]
    others = {topo.prefill.port, topo.prefill.bootstrap_port, topo.relay.port, topo.main.port,
              topo.main.control_port, topo.main.wan_listen_port, topo.router_port, topo.wan.listen_port,
              topo.wan.control_port}
    assert not others & set(ranks)
    for port in ranks:
        with socket.socket() as s:
            s.bind((LOOPBACK, port))  # free now
    assert not {free_port() for _ in range(200)} & set(ranks)  # and not handed out again
    assert Topology.on_free_ports().prefill.tp == 1


# ---- MD with --tp N: N WAN receivers on consecutive ports, one emulated link per rank

def test_md_tp_gets_its_tp_cores_and_the_first_of_n_wan_ports():
    from sglang_pdd.launcher.topology import wan_emulator_argvs

    topo = Topology.on_free_ports(main_tp=3)
    argv = server_argv(topo.main, "/m", "/k")
    assert topo.main.tp == 3 and flag_values(argv, "--tp") == ["3"]
    assert flag_values(argv, "--pdd-wan-listen") == [f"{LOOPBACK}:{topo.main.wan_listen_port}"]  # rank r adds r
    assert server_env(topo.main, cores=[0, 1, 2])["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1|2"
    links = wan_emulator_argvs(topo)
    assert [name for name, _, _ in links] == ["wan-emulator", "wan-emulator-1", "wan-emulator-2"]
    for r, (_, link, health) in enumerate(links):
        assert flag_values(link, "--listen") == [f"{LOOPBACK}:{topo.wan.listen_port + r}"]
        assert flag_values(link, "--upstream") == [f"{LOOPBACK}:{topo.main.wan_listen_port + r}"]
        assert flag_values(link, "--control") == [f"{LOOPBACK}:{topo.wan.control_port + r}"]
        assert health == f"http://{LOOPBACK}:{topo.wan.control_port + r}/stats"
    # the router and P know link 0's address only: P adds MD's rank to the port
    assert flag_values(router_argv(topo, "/m"), "--main")[0].endswith(f",{LOOPBACK}:{topo.wan.listen_port}")
    assert flag_values(server_argv(topo.prefill, "/m", "/k"), "--pdd-wan-peers") == [
        f"{LOOPBACK}:{topo.wan.listen_port}"]


def test_md_tp_ports_are_consecutive_free_and_distinct():
    topo = Topology.on_free_ports(prefill_tp=2, main_tp=4)
    runs = [range(topo.main.wan_listen_port, topo.main.wan_listen_port + 4),
            range(topo.wan.listen_port, topo.wan.listen_port + 4),
            range(topo.wan.control_port, topo.wan.control_port + 4),
            range(topo.prefill.control_port, topo.prefill.control_port + 2)]
    singles = [topo.prefill.port, topo.prefill.bootstrap_port, topo.relay.port, topo.main.port,
               topo.main.control_port, topo.router_port]
    ports = [p for run in runs for p in run] + singles
    assert len(set(ports)) == len(ports)
    for port in ports:
        with socket.socket() as s:
            s.bind((LOOPBACK, port))  # free now
    default = Topology.on_free_ports()
    assert default.main.tp == 1 and default.wan.links == 1 and len(default.wan.control_urls) == 1


def test_wan_control_reaches_every_link(tmp_path):
    """partition / heal / rate changes must hit all of MD's links, or one rank's KV still flows."""
    import http.server
    import threading

    from sglang_pdd.launcher.cluster import LocalCluster

    topo = Topology.on_free_ports(main_tp=2)
    seen, servers = [], []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append((self.server.server_address[1], self.path))
            body = b'{"ok": true, "port": %d}' % self.server.server_address[1]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    for r in range(2):
        server = http.server.HTTPServer((LOOPBACK, topo.wan.control_port + r), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        cluster = LocalCluster(tmp_path, model_path="/m", topology=topo)
        assert cluster.wan_control("partition") == {"ok": True, "port": topo.wan.control_port}
        assert [a["port"] for a in cluster.wan_control_each("link", rate_gbps=0.5)] == \
            [topo.wan.control_port, topo.wan.control_port + 1]
        assert sorted(seen) == sorted([(topo.wan.control_port + r, path) for r in range(2)
                                       for path in ("/partition", "/link?rate_gbps=0.5")])
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_free_ports_stay_out_of_mooncakes_random_range(monkeypatch):
    """Mooncake's engines bind random ports of MOONCAKE_PORTS while servers start: a port handed
    out there could be gone by the time its server binds it (MD's control API failed so)."""
    import random

    from sglang_pdd.launcher import topology

    picks = iter([15000, 16999, 14999, 14998])  # two inside the range, a pair reaching into it, then below it
    monkeypatch.setattr(random, "randint", lambda lo, hi: next(picks))
    monkeypatch.setattr(topology, "_handed_out", set())
    monkeypatch.setattr(topology, "_bindable", lambda host, port: True)
    assert topology.free_port(count=2) == 14998
