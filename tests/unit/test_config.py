"""The --pdd-* flags: parsing and the start-up validation that names the offending flag."""

import argparse
import re

import pytest

from sglang_pdd.config import PddConfig, PddConfigError, add_pdd_args, config_from_namespace, validate


def parse(*argv: str) -> PddConfig:
    parser = argparse.ArgumentParser()
    parser.add_argument("--disaggregation-mode", default="null")
    # "pdd" by default here, so each case below states only what it is about
    parser.add_argument("--disaggregation-transfer-backend", default="pdd")
    add_pdd_args(parser)
    ns = parser.parse_args(list(argv))
    return config_from_namespace(ns), ns.disaggregation_mode, ns.disaggregation_transfer_backend


GOOD = [
    ([], None),
    (["--pdd-role", "prefill", "--disaggregation-mode", "prefill", "--pdd-wan-key-file", "k",
      "--pdd-wan-streams", "8", "--disaggregation-transfer-backend", "pdd"], "prefill"),
    (["--pdd-role", "prefill", "--disaggregation-mode", "prefill", "--pdd-wan-key-file", "k",
      "--pdd-intra-dc-transport", "tcp", "--pdd-wan-staging-mb", "64",
      "--disaggregation-transfer-backend", "pdd"], "prefill"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-datacenter", "dc-a",
      "--disaggregation-transfer-backend", "pdd"], "relay"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-intra-dc-transport", "tcp",
      "--pdd-wan-key-file", "k", "--disaggregation-transfer-backend", "pdd"], "relay"),
    (["--pdd-role", "prefill", "--disaggregation-mode", "prefill", "--pdd-wan-key-file", "k",
      "--pdd-control-listen", "127.0.0.1:7002", "--pdd-wan-destination-wait-ms", "500"], "prefill"),
    # a plain PD pair on another backend is none of the plugin's business
    (["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake"], None),
    (["--pdd-role", "main", "--pdd-wan-listen", "127.0.0.1:7000", "--pdd-control-listen", "127.0.0.1:7001",
      "--pdd-wan-key-file", "k"], "main"),
    (["--pdd-role", "main", "--pdd-wan-listen", "127.0.0.1:7000", "--pdd-control-listen", "127.0.0.1:7001",
      "--pdd-wan-key-file", "k", "--pdd-md-staging-mb", "256", "--pdd-md-ingest", "staged"], "main"),
    (["--pdd-role", "main", "--pdd-wan-listen", "127.0.0.1:7000", "--pdd-control-listen", "127.0.0.1:7001",
      "--pdd-wan-key-file", "k", "--pdd-kv-trusted-sources", "10.0.0.5,10.1.0.0/16,fd00::/8",
      "--pdd-kv-max-handshakes-per-source", "4", "--pdd-kv-reserved-handshakes", "48"], "main"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-intra-dc-transport", "tcp",
      "--pdd-wan-key-file", "k", "--pdd-kv-trusted-sources", "10.0.0.5"], "relay"),
]


@pytest.mark.parametrize("argv,role", GOOD)
def test_consistent_flags_validate(argv, role):
    cfg, mode, backend = parse(*argv)
    assert validate(cfg, mode, backend) is cfg
    assert cfg.role == role and cfg.active == (role is not None)


BAD = [
    (["--pdd-role", "prefill", "--disaggregation-mode", "prefill", "--pdd-wan-key-file", "k",
      "--pdd-md-staging-mb", "64"], "--pdd-md-staging-mb applies only to --pdd-role main"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-md-ingest", "staged"],
     "--pdd-md-ingest applies only to --pdd-role main"),
    (["--pdd-role", "main", "--pdd-wan-listen", "h:7", "--pdd-control-listen", "h:8", "--pdd-wan-key-file", "k",
      "--pdd-md-staging-mb", "-1"], "--pdd-md-staging-mb must be >= 1"),
    (["--pdd-wan-streams", "8"], "--pdd-wan-streams was given without --pdd-role"),
    (["--pdd-role", "prefill", "--pdd-wan-key-file", "k"], "needs --disaggregation-mode prefill"),
    (["--pdd-role", "relay", "--disaggregation-mode", "prefill"], "needs --disaggregation-mode decode"),
    (["--pdd-role", "main", "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake",
      "--pdd-wan-listen", "h:1",
      "--pdd-control-listen", "h:2", "--pdd-wan-key-file", "k"], "needs no --disaggregation-mode"),
    (["--pdd-role", "main", "--pdd-wan-key-file", "k"], "needs --pdd-wan-listen"),
    (["--pdd-role", "main", "--pdd-wan-listen", "nohost", "--pdd-wan-key-file", "k"], "--pdd-wan-listen must be HOST:PORT"),
    (["--pdd-role", "main", "--pdd-wan-listen", "h:70000", "--pdd-wan-key-file", "k"], "--pdd-wan-listen must be HOST:PORT"),
    (["--pdd-role", "main", "--pdd-wan-listen", "h:7"], "needs --pdd-control-listen"),
    (["--pdd-role", "main", "--pdd-wan-listen", "h:7", "--pdd-control-listen", "h:x"], "--pdd-control-listen must be HOST:PORT"),
    (["--pdd-role", "main", "--pdd-wan-listen", "h:7", "--pdd-control-listen", "h:8"], "needs --pdd-wan-key-file"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-control-listen", "h:7"], "--pdd-control-listen applies only"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-wan-listen", "h:7"], "--pdd-wan-listen applies only"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-intra-dc-transport", "tcp"],
     "--pdd-intra-dc-transport tcp needs --pdd-wan-key-file"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-wan-streams", "2"], "--pdd-wan-streams applies only"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-wan-destination-wait-ms", "5"],
     "--pdd-wan-destination-wait-ms applies only"),
    (["--pdd-role", "prefill", "--disaggregation-mode", "prefill", "--pdd-wan-key-file", "k",
      "--pdd-control-listen", "nohost"], "--pdd-control-listen must be HOST:PORT"),
    (["--pdd-role", "prefill", "--disaggregation-mode", "prefill", "--pdd-wan-key-file", "k",
      "--pdd-wan-destination-wait-ms", "-1"], "--pdd-wan-destination-wait-ms must be in 0..60000"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-wan-staging-mb", "64"],
     "--pdd-wan-staging-mb applies only"),
    (["--pdd-role", "main", "--pdd-wan-listen", "h:7", "--pdd-control-listen", "h:8", "--pdd-wan-key-file", "k",
      "--pdd-intra-dc-transport", "tcp"], "--pdd-intra-dc-transport applies only"),
    (["--pdd-role", "prefill", "--disaggregation-mode", "prefill", "--pdd-wan-key-file", "k",
      "--pdd-wan-streams", "0"], "--pdd-wan-streams must be in 1..64"),
    (["--pdd-role", "prefill", "--disaggregation-mode", "prefill", "--pdd-wan-key-file", "k",
      "--pdd-wan-timeout-s", "0"], "--pdd-wan-timeout-s must be > 0"),
    (["--pdd-role", "prefill", "--disaggregation-mode", "prefill", "--pdd-wan-key-file", "k",
      "--pdd-wan-staging-mb", "1"], "--pdd-wan-staging-mb must be >= 16"),
    (["--pdd-role", "prefill", "--disaggregation-mode", "prefill", "--pdd-wan-key-file", "k",
      "--disaggregation-transfer-backend", "mooncake"], "needs --disaggregation-transfer-backend pdd"),
    (["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "pdd"],
     "needs --pdd-role prefill (P) or relay (RLD)"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-kv-trusted-sources", "10.0.0.300"],
     "--pdd-kv-trusted-sources: not an IP address or network: '10.0.0.300'"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-kv-max-handshakes-per-source", "0"],
     "--pdd-kv-max-handshakes-per-source must be >= 1"),
    (["--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-kv-reserved-handshakes", "64"],
     "--pdd-kv-reserved-handshakes must be in 0..63"),
    (["--pdd-kv-trusted-sources", "10.0.0.5"], "--pdd-kv-trusted-sources was given without --pdd-role"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_inconsistent_flags_name_the_flag(argv, message):
    cfg, mode, backend = parse(*argv)
    with pytest.raises(PddConfigError, match=re.escape(message)):
        validate(cfg, mode, backend)


def test_kv_admission_flags_reach_the_acceptors_limits():
    from sglang_pdd.config import admission_limits
    from sglang_pdd.kv_channel.acceptor import AdmissionLimits, parse_networks

    cfg, _, _ = parse("--pdd-role", "relay", "--disaggregation-mode", "decode", "--pdd-kv-trusted-sources",
                      "10.0.0.5, 10.1.0.0/16", "--pdd-kv-max-handshakes-per-source", "4",
                      "--pdd-kv-reserved-handshakes", "40")
    assert admission_limits(cfg) == AdmissionLimits(per_source=4, reserved=40,
                                                    trusted=parse_networks("10.0.0.5,10.1.0.0/16"))
    assert admission_limits(PddConfig()) == AdmissionLimits()  # the flags' defaults are the acceptor's


def test_control_admission_and_name_flags_are_checked_and_reach_the_server_names(tmp_path):
    from sglang_pdd.config import control_names
    from sglang_pdd.kv_channel.tls import control_server_names

    main = dict(role="main", wan_listen="10.0.0.1:1", control_listen="10.1.0.7:18001", wan_key_file="k")
    cfg = PddConfig(**main, control_trusted_sources="10.2.0.9, 10.3.0.0/24", control_names="MD-ctl.example,fd00::7")
    assert validate(cfg, "null") is cfg
    assert control_names(cfg) == ("md-ctl.example", "fd00::7")
    assert control_server_names("10.1.0.7", control_names(cfg)) == ("10.1.0.7", "md-ctl.example", "fd00::7")
    assert control_server_names("0.0.0.0") == ()  # a wildcard bind with no names: any host at its port
    with pytest.raises(PddConfigError, match="--pdd-control-trusted-sources.*'10.2.0.300'"):
        validate(PddConfig(**main, control_trusted_sources="10.2.0.300"), "null")
    # a proxy in front of the API on another port: its name with that port
    assert validate(PddConfig(**main, control_names="md.example:18001,[fd00::7]:443"), "null")
    for bad in ("md.example:0", "md.example:99999", "http://md.example", "a@b"):
        with pytest.raises(PddConfigError, match="--pdd-control-names"):
            validate(PddConfig(**main, control_names=bad), "null")
    with pytest.raises(PddConfigError, match="needs --pdd-control-listen"):
        validate(PddConfig(role="relay", control_trusted_sources="10.2.0.9"), "decode", "pdd")


def test_unknown_role_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        parse("--pdd-role", "router")


def test_md_and_p_take_any_tp_with_one_wan_port_per_md_rank():
    cfg, mode, backend = parse(*GOOD[7][0])  # main
    assert validate(cfg, mode, backend, tp_size=1) is cfg
    assert validate(cfg, mode, backend, tp_size=2) is cfg  # ranks' rooms run in lockstep (md/main_drc.py)
    port = int(cfg.wan_listen.rpartition(":")[2])
    assert validate(cfg, mode, backend, tp_size=65536 - port) is cfg  # the last rank on port 65535
    with pytest.raises(PddConfigError, match=re.escape(f"--pdd-wan-listen port {port} + {65536 - port} "
                                                       f"(one port per TP rank) exceeds 65535")):
        validate(cfg, mode, backend, tp_size=65537 - port)
    cfg, mode, backend = parse(*GOOD[1][0])  # prefill: each rank sends its heads' slice
    assert cfg.role == "prefill" and validate(cfg, mode, backend, tp_size=4) is cfg


def test_plain_servers_and_relays_keep_their_tp():
    for argv in ([], GOOD[3][0]):  # no role; relay (its TP is SGLang's PD business)
        cfg, mode, backend = parse(*argv)
        assert validate(cfg, mode, backend, tp_size=2) is cfg


def test_md_staging_default_is_a_share_of_mds_kv_pool():
    from sglang_pdd.config import MD_STAGING_POOL_SHARE, md_staging_bytes
    cfg, _, _ = parse("--pdd-role", "main", "--pdd-wan-listen", "h:7", "--pdd-control-listen", "h:8",
                      "--pdd-wan-key-file", "k")
    assert cfg.md_staging_mb == 0  # the default: derived when MD's pool exists
    # DeepSeek-V3 (70,272 B/token) on a 9.9M-token pool vs Llama-3-70B (327,680 B/token) on 624k
    ds, ll = md_staging_bytes(0, 9_900_000, 70_272), md_staging_bytes(0, 624_000, 327_680)
    assert ds == int(MD_STAGING_POOL_SHARE * 9_900_000 * 70_272) and ll == int(MD_STAGING_POOL_SHARE * 624_000 * 327_680)
    assert ds > 100 * 2 ** 30 and ll > 40 * 2 ** 30  # 4 GiB held one long prompt
    assert md_staging_bytes(256, 9_900_000, 70_272) == 256 << 20  # an explicit size wins
