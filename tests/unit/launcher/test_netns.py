"""Datacenter B in a network namespace: the pure parts (names, owners, subnets, tc argv,
counters) and the argv the launcher builds for servers placed there. No namespace is made
here; tests/e2e/test_e2e_netns_cleanup.py makes real ones."""

import ipaddress

import pytest

from sglang_pdd.launcher import netns
from sglang_pdd.launcher.netns import (Owner, link_counters, namespace_name, owner_alias, owner_alive,
                                       owner_of_alias, owner_of_namespace, parse_netns_list, pick_subnet,
                                       plan_link, process_start_ticks, tbf_argv, tbf_burst_bytes, used_networks,
                                       veth_names)
from sglang_pdd.launcher.sglang_pd import SglangPdTopology, pd_router_argv, pd_server_argv, pd_server_env
from sglang_pdd.launcher.topology import Topology, router_argv, server_argv, server_env, wan_emulator_argvs


def test_names_carry_their_owner_and_round_trip():
    owner = Owner(4194304, 123456789)
    name = namespace_name(owner, 3)
    assert owner_of_namespace(name) == owner
    assert owner_of_alias(owner_alias(owner)) == owner
    a, b = veth_names(owner, 999)
    assert len(a) <= 15 and len(b) <= 15 and a != b  # IFNAMSIZ with the largest Linux pid
    with pytest.raises(ValueError):
        veth_names(owner, 1000)


@pytest.mark.parametrize("name", ["pdd-dc-12-x-0", "other-ns", "pdd-dc-1-2", "pdd-dc-1-2-3-4", ""])
def test_foreign_names_have_no_owner(name):
    assert owner_of_namespace(name) is None


@pytest.mark.parametrize("alias", ["", "pdd-dc owner=", "pdd-dc owner=12", "pdd-dc owner=a:1", "someone else's"])
def test_foreign_aliases_have_no_owner(alias):
    assert owner_of_alias(alias) is None


def test_an_owner_is_alive_only_with_its_own_start_time():
    ticks = {10: 500}.get
    assert owner_alive(Owner(10, 500), ticks)
    assert not owner_alive(Owner(10, 499), ticks)  # the pid was reused by a later process
    assert not owner_alive(Owner(11, 500), ticks)  # no such process


def test_this_process_start_time_is_read_and_a_missing_pid_has_none(tmp_path):
    import os

    assert process_start_ticks(os.getpid()) == netns.current_owner().start_ticks > 0
    (tmp_path / "77").mkdir()
    # a command name with spaces and parentheses: fields are counted from the last ')'
    (tmp_path / "77" / "stat").write_text("77 (a (b) c) S " + " ".join(str(i) for i in range(4, 30)))
    assert process_start_ticks(77, proc=tmp_path) == 22
    assert process_start_ticks(78, proc=tmp_path) is None


def test_netns_list_parsing():
    assert parse_netns_list("pdd-dc-1-2-0 (id: 0)\nplain\n\n") == ["pdd-dc-1-2-0", "plain"]


def test_subnet_is_free_and_search_wraps():
    text = ("1: lo    inet 127.0.0.1/8 scope host lo\n"
            "4: eth0    inet 10.211.0.5/30 brd 10.211.0.7 scope global eth0\n")
    used = used_networks(text)
    assert ipaddress.ip_network("10.211.0.4/30") in used
    assert pick_subnet(1, used) == ipaddress.ip_network("10.211.0.8/30")  # block 1 is taken: the next
    pool = ipaddress.ip_network("10.0.0.0/29")  # two /30s
    assert pick_subnet(1, [ipaddress.ip_network("10.0.0.4/30")], pool) == ipaddress.ip_network("10.0.0.0/30")
    with pytest.raises(netns.NetnsUnavailable):
        pick_subnet(0, [pool], pool)


def test_plan_gives_two_hosts_of_one_subnet():
    plan = plan_link(Owner(1234, 99), 0, [])
    a, b = ipaddress.ip_address(plan.a_ip), ipaddress.ip_address(plan.b_ip)
    net = ipaddress.ip_network(f"{plan.a_ip}/{plan.prefix_len}", strict=False)
    assert a != b and b in net and net.subnet_of(netns.SUBNET_POOL)
    assert plan.namespace == namespace_name(Owner(1234, 99), 0)


def test_tbf_argv_add_and_change():
    add = tbf_argv("pdd1a0", 20)
    assert add[:6] == ["tc", "qdisc", "add", "dev", "pdd1a0", "root"]
    assert add[6:10] == ["tbf", "rate", "20000kbit", "burst"] and "latency" in add
    change = tbf_argv("pdd1b0", 0.5, change=True, netns="ns")
    assert change[:4] == ["ip", "netns", "exec", "ns"] and change[6] == "change"
    assert tbf_burst_bytes(0.5) == 16 * 1024 and tbf_burst_bytes(1000) == 250_000
    with pytest.raises(ValueError):
        tbf_argv("x", 0)


def test_counters_read_from_statistics(tmp_path):
    (tmp_path / "tx_bytes").write_text("1234\n")
    (tmp_path / "rx_bytes").write_text("56\n")
    assert link_counters(tmp_path) == (1234, 56)


def test_pdd_topology_with_datacenter_b_in_a_namespace():
    topo = Topology.on_free_ports().place_datacenter_b("10.211.0.2", "pdd-dc-1-2-0", 0.02)
    md, p = topo.main, topo.prefill
    assert wan_emulator_argvs(topo) == []  # the kernel link is the WAN: no emulator
    assert p.wan_peers == [f"10.211.0.2:{md.wan_listen_port}"]  # P dials MD directly
    argv = server_argv(md, "/m", "/k")
    assert argv[argv.index("--host") + 1] == "0.0.0.0"  # the namespace's own interfaces only
    assert argv[argv.index("--pdd-wan-listen") + 1] == f"10.211.0.2:{md.wan_listen_port}"
    assert argv[argv.index("--pdd-control-listen") + 1] == f"10.211.0.2:{md.control_port}"
    assert server_env(md)["SGLANG_HOST_IP"] == "10.211.0.2"
    assert server_argv(p, "/m", "/k")[server_argv(p, "/m", "/k").index("--host") + 1] == "127.0.0.1"
    router = router_argv(topo, "/m")
    assert router[router.index("--main") + 1] == f"{md.url},{md.control_url},10.211.0.2:{md.wan_listen_port}"
    assert md.url.startswith("http://10.211.0.2:")
    assert router[router.index("--wan-rtt-ms") + 1] == "0.0" and router[router.index("--wan-gbps") + 1] == "0.02"


def test_pdd_topology_without_namespace_is_unchanged():
    topo = Topology.on_free_ports()
    assert topo.prefill.wan_peers == [f"127.0.0.1:{topo.wan.listen_port}"]
    assert [name for name, _, _ in wan_emulator_argvs(topo)] == ["wan-emulator"]
    assert server_env(topo.main)["SGLANG_HOST_IP"] == "127.0.0.1"


def test_sglang_pd_baseline_argv():
    topo = SglangPdTopology.on_free_ports()
    topo.extra_args = ["--dtype", "float32"]
    pre, dec = pd_server_argv(topo, topo.prefill, "/m"), pd_server_argv(topo, topo.decode, "/m")
    for argv in (pre, dec):
        assert "--pdd-role" not in argv and argv[-2:] == ["--dtype", "float32"]
        assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "mooncake"
        assert argv[argv.index("--page-size") + 1] == "1"
    assert pre[pre.index("--disaggregation-mode") + 1] == "prefill"
    assert pre[pre.index("--disaggregation-bootstrap-port") + 1] == str(topo.bootstrap_port)
    assert dec[dec.index("--disaggregation-mode") + 1] == "decode"
    assert "--disaggregation-decode-enable-radix-cache" not in dec
    assert pd_server_env(topo.decode)["SGLANG_PLUGINS"] == "none"  # not the pdd plugin
    router = pd_router_argv(topo)
    assert router[router.index("--prefill") + 1:router.index("--prefill") + 3] == [topo.prefill.url,
                                                                                 str(topo.bootstrap_port)]
    assert "--pd-disaggregation" in router


def test_sglang_pd_cross_datacenter_placement():
    topo = SglangPdTopology.on_free_ports(decode_radix_cache=True)
    topo.place_decode_in_datacenter_b("10.211.0.1", "10.211.0.2", "pdd-dc-1-2-0")
    assert topo.prefill.url.startswith("http://10.211.0.1:") and topo.decode.url.startswith("http://10.211.0.2:")
    assert pd_server_env(topo.prefill)["SGLANG_HOST_IP"] == "10.211.0.1"
    assert pd_server_env(topo.decode)["SGLANG_HOST_IP"] == "10.211.0.2"
    assert "--disaggregation-decode-enable-radix-cache" in pd_server_argv(topo, topo.decode, "/m")
