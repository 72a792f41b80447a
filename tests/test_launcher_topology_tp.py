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
