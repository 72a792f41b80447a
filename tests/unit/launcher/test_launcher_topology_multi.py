"""The launcher's topology with several P and MD: names, WAN links, P's WAN peers, router args (pure)."""

from __future__ import annotations

from sglang_pdd.launcher.topology import LOOPBACK, Topology, router_argv, server_argv, wan_emulator_argvs


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_default_topology_is_one_of_each():
    topo = Topology.on_free_ports()
    assert [s.name for s in topo.servers] == ["prefill-0", "relay-0", "main-0"]
    assert topo.prefills == [topo.prefill] and topo.mains == [topo.main] and topo.wans == [topo.wan]
    assert [name for name, _, _ in wan_emulator_argvs(topo)] == ["wan-emulator"]
    argv = router_argv(topo, "/m")
    assert len(flag_values(argv, "--prefill")) == 1
    assert flag_values(argv, "--main") == [f"{topo.main.url},{topo.main.control_url},{LOOPBACK}:{topo.wan.listen_port}"]


def test_two_p_two_md():
    topo = Topology.on_free_ports(prefills=2, mains=2)
    assert [s.name for s in topo.servers] == ["prefill-0", "prefill-1", "relay-0", "main-0", "main-1"]
    assert topo.prefill is topo.prefills[0] and topo.main is topo.mains[0] and topo.wan is topo.wans[0]
    ports = [s.port for s in topo.servers] + [w.listen_port for w in topo.wans] + [w.control_port for w in topo.wans]
    assert len(set(ports)) == len(ports)
    links = [f"{LOOPBACK}:{w.listen_port}" for w in topo.wans]
    for p in topo.prefills:  # every P may send KV to every MD, through that MD's link only
        assert flag_values(server_argv(p, "/m", "/k"), "--pdd-wan-peers") == [",".join(links)]
    emulators = wan_emulator_argvs(topo)
    assert [name for name, _, _ in emulators] == ["wan-emulator", "wan-emulator-main-1"]
    for (_, argv, _), main, link in zip(emulators, topo.mains, links):
        assert flag_values(argv, "--listen") == [link]
        assert flag_values(argv, "--upstream") == [f"{LOOPBACK}:{main.wan_listen_port}"]
    argv = router_argv(topo, "/m")
    assert [a.split(",")[0] for a in flag_values(argv, "--prefill")] == [p.url for p in topo.prefills]
    assert flag_values(argv, "--main") == [f"{m.url},{m.control_url},{link}" for m, link in zip(topo.mains, links)]


def test_the_router_is_allow_listed_on_every_control_api():
    """A valid control call makes its source nothing (a replay would too): the reserved control
    connections are the allow-list's only, so the launcher lists its router (on loopback)."""
    topo = Topology.on_free_ports(prefills=2, mains=2)
    for spec in (*topo.prefills, *topo.mains):
        assert flag_values(server_argv(spec, "/m", "/k"), "--pdd-control-trusted-sources") == [LOOPBACK], spec.name
    assert flag_values(server_argv(topo.relay, "/m", "/k"), "--pdd-control-trusted-sources") == []
