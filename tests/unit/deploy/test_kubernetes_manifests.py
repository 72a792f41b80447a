"""deploy/kubernetes renders (``kubectl kustomize``) and validates: built-in kinds with
``kubernetes-validate --strict`` (its bundled schemas), the RoleBasedGroup and LeaderWorkerSet
objects against their CRDs' openAPIV3Schema (vendored: deploy/kubernetes/crd-schemas/README.md;
CEL rules are not evaluated). Then what no schema checks: the pods the manifests make are the
backends the router's discovery finds (its own pure logic on the rendered templates), the
router's arguments parse with its own parser, probes hit routes the servers serve, the
NetworkPolicies open the ports the containers listen on, and the secrets are files the
servers accept (the kubelet's symlinked layout, mode 0400, no fsGroup)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sglang_pdd.router.front import cli

from sglang_pdd.router.front import discovery_setup
from sglang_pdd.router.discovery.pods import DiscoveryState, Selector

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy" / "kubernetes"
OVERLAYS = ["cluster-a-rbg", "cluster-a-plain", "cluster-b-lws", "cluster-b-statefulset"]
K8S_VERSIONS = ["1.30.0", "1.37.0"]  # the oldest with preStop sleep on by default, the newest bundled
CRDS = {("workloads.x-k8s.io/v1alpha2", "RoleBasedGroup"): "rolebasedgroup-workloads.x-k8s.io-v1alpha2.json",
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset-leaderworkerset.x-k8s.io-v1.json"}

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl not installed (scripts/setup.sh installs it where apt has it)")

_rendered: dict[str, list[dict]] = {}


def render(overlay: str) -> list[dict]:
    if overlay not in _rendered:
        out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "overlays" / overlay)], check=True,
                             capture_output=True, text=True, timeout=120).stdout
        _rendered[overlay] = [d for d in yaml.safe_load_all(out) if d]
    return _rendered[overlay]


def pod_templates(objs: list[dict]) -> dict[str, dict]:
    """role label -> pod template, from whatever workload kind holds it."""
    found = {}
    for o in objs:
        spec = o.get("spec") or {}
        templates = []
        if o["kind"] in ("Deployment", "StatefulSet"):
            templates = [spec["template"]]
        elif o["kind"] == "RoleBasedGroup":
            templates = [r["standalonePattern"]["template"] for r in spec["roles"]]
        elif o["kind"] == "LeaderWorkerSet":
            templates = [spec["leaderWorkerTemplate"]["workerTemplate"]]
        for t in templates:
            found[t["metadata"]["labels"]["pdd.sglang.ai/role"]] = t
    return found


def params(objs: list[dict]) -> dict[str, str]:
    return next(o["data"] for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "pdd-params")


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """kubelet's $(VAR) expansion of a container's args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def container_env(container: dict, cm: dict[str, str], pod: dict[str, str]) -> dict[str, str]:
    env = {}
    for e in container.get("env", []):
        src = e.get("valueFrom") or {}
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in src:
            env[e["name"]] = cm[src["configMapKeyRef"]["key"]]
        elif "fieldRef" in src:
            env[e["name"]] = pod[src["fieldRef"]["fieldPath"]]
    return env


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_and_validates_strictly(overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    import jsonschema

    objs = render(overlay)
    kinds = sorted(o["kind"] for o in objs)
    custom = [o for o in objs if (o["apiVersion"], o["kind"]) in CRDS]
    for version in K8S_VERSIONS:
        for o in objs:
            if (o["apiVersion"], o["kind"]) not in CRDS:
                kubernetes_validate.validate(o, version, strict=True)  # raises ValidationError
    for o in custom:
        schema = json.loads((DEPLOY / "crd-schemas" / CRDS[(o["apiVersion"], o["kind"])]).read_text())
        jsonschema.validate(o, schema)
    assert all(o["metadata"].get("namespace") == "sglang-pdd" for o in objs if o["kind"] != "Namespace")
    expected_workloads = {"cluster-a-rbg": ["RoleBasedGroup"], "cluster-a-plain": ["Deployment"] * 3,
                          "cluster-b-lws": ["LeaderWorkerSet"], "cluster-b-statefulset": ["StatefulSet"]}[overlay]
    assert [k for k in kinds if k in ("RoleBasedGroup", "Deployment", "LeaderWorkerSet", "StatefulSet")] == \
        expected_workloads
    print(f"{overlay}: {len(objs)} objects ({', '.join(f'{kinds.count(k)} {k}' for k in sorted(set(kinds)))}); "
          f"built-ins valid (strict) for Kubernetes {', '.join(K8S_VERSIONS)}; {len(custom)} custom resource(s) valid")


def test_a_crd_schema_catches_a_wrong_field():
    import jsonschema

    schema = json.loads((DEPLOY / "crd-schemas" / CRDS[("workloads.x-k8s.io/v1alpha2", "RoleBasedGroup")]).read_text())
    bad = {"apiVersion": "workloads.x-k8s.io/v1alpha2", "kind": "RoleBasedGroup", "metadata": {"name": "x"},
           "spec": {"roles": [{"name": "p", "replicas": "two"}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_the_workload_files_are_what_the_generator_writes():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_kubernetes_templates.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@needs_kubectl
def test_both_variants_of_each_cluster_run_the_same_pods():
    assert pod_templates(render("cluster-a-rbg")) == pod_templates(render("cluster-a-plain"))
    assert pod_templates(render("cluster-b-lws")) == pod_templates(render("cluster-b-statefulset"))
    assert set(pod_templates(render("cluster-a-rbg"))) == {"router", "prefill", "relay"}


def router_args(objs) -> tuple[list[str], dict[str, str]]:
    router = pod_templates(objs)["router"]["spec"]["containers"][0]
    env = container_env(router, params(objs), {"status.podIP": "10.0.0.9", "metadata.name": "pdd-router-x",
                                               "metadata.namespace": "sglang-pdd"})
    return expand(router["args"], env), env


@needs_kubectl
def test_the_pods_are_the_backends_the_routers_discovery_finds():
    a, b = render("cluster-a-plain"), render("cluster-b-statefulset")
    argv, _ = router_args(a)
    args = cli.parse_args(argv)
    assert discovery_setup.check_args(args) is None and discovery_setup.main_elsewhere(args)
    assert args.service_discovery_namespace == "sglang-pdd" == args.main_discovery_namespace
    here = DiscoveryState({role: Selector.parse(sel) for role, sel in (("prefill", args.prefill_selector),
                                                                      ("relay", args.relay_selector))})
    there = DiscoveryState({"main": Selector.parse(args.main_selector)})
    templates = {**pod_templates(a), **pod_templates(b)}

    def as_pod(role: str, name: str, ip: str) -> dict:
        t = templates[role]
        return {"metadata": {**t["metadata"], "name": name, "namespace": "sglang-pdd"},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}

    (p,) = here.apply("ADDED", as_pod("prefill", "pdd-prefill-x", "10.0.0.5")).changes
    (r,) = here.apply("ADDED", as_pod("relay", "pdd-relay-x", "10.0.0.6")).changes
    assert here.apply("ADDED", as_pod("router", "pdd-router-x", "10.0.0.9")).changes == []  # not a backend
    assert p.backend.url == "http://10.0.0.5:30000" and p.backend.bootstrap_port == 8998
    assert p.backend.control_url == "http://10.0.0.5:31000" and r.backend.url == "http://10.0.0.6:30000"
    (md,) = there.apply("ADDED", as_pod("main", "pdd-md-0", "10.1.0.7")).changes
    host = "pdd-md-0.sglang-pdd.svc.clusterset.local"
    assert (md.backend.url, md.backend.control_url, md.backend.wan_addr) == \
        (f"http://{host}:30000", f"http://{host}:31002", f"{host}:17000")
    # P sends KV only to its --pdd-wan-peers: every MD the router can find must be there
    assert md.backend.wan_addr in params(a)["MD_WAN_PEERS"].split(",")
    assert len(params(a)["MD_WAN_PEERS"].split(",")) == next(
        o for o in b if o["kind"] == "StatefulSet")["spec"]["replicas"]
    # each per-pod Service is the host MD's annotation advertises, with its ports
    services = {o["metadata"]["name"]: o for o in b if o["kind"] == "Service"}
    assert services["pdd-md-0"]["spec"]["selector"] == {"statefulset.kubernetes.io/pod-name": "pdd-md-0"}
    assert {pt["port"] for pt in services["pdd-md-0"]["spec"]["ports"]} == {30000, 31002, 17000}
    # MD's control API serves a signed call only under a name it knows: the one the router dials
    md_container = templates["main"]["spec"]["containers"][0]
    md_args = expand(md_container["args"], container_env(md_container, params(b), {
        "status.podIP": "10.1.0.7", "metadata.name": "pdd-md-0", "metadata.namespace": "sglang-pdd"}))
    assert md_args[md_args.index("--pdd-control-names") + 1] == host
    assert md_args[md_args.index("--pdd-control-listen") + 1] == "10.1.0.7:31002"


@needs_kubectl
def test_every_pdd_flag_the_servers_get_exists():
    from sglang_pdd.config import FLAGS

    known = {f.flag for f in FLAGS}
    for overlay in ("cluster-a-plain", "cluster-b-statefulset"):
        for role, t in pod_templates(render(overlay)).items():
            used = {a for a in t["spec"]["containers"][0].get("args", []) if a.startswith("--pdd-")}
            assert used <= known, (role, used - known)


@needs_kubectl
def test_probes_hit_routes_the_servers_serve(router_sglang_state):
    from sglang.srt.entrypoints.http_server import HEALTH_CHECK_TIMEOUT
    from sglang.srt.entrypoints.http_server import app as sglang_app

    from sglang_pdd.router.front.app import Router, build_app
    from sglang_pdd.router.backends.pools import Pools

    sglang_routes = {getattr(r, "path", None) for r in sglang_app.routes}
    router = Router(Pools([], [], [], allow_empty=True), cli.flow_config(cli.parse_args(["--tokenizer-path", "m"])),
                    None, 1000, "m", sglang_state=router_sglang_state)
    router_routes = {r.resource.canonical for r in build_app(router).router.routes()}
    for overlay in ("cluster-a-plain", "cluster-b-statefulset"):
        for role, t in pod_templates(render(overlay)).items():
            c = t["spec"]["containers"][0]
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                get = c[probe]["httpGet"]
                assert get["port"] in ports
                assert get["path"] in (router_routes if role == "router" else sglang_routes), (role, probe)
                if role != "router":  # SGLang's /health decodes a token: >= 1 s, up to its timeout
                    assert c[probe].get("timeoutSeconds", 1) > HEALTH_CHECK_TIMEOUT, (role, probe)


@needs_kubectl
def test_network_policies_open_the_ports_the_containers_serve_to_their_peers_only():
    for overlay in ("cluster-a-plain", "cluster-b-statefulset"):
        objs = render(overlay)
        policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
        deny = next(p for p in policies if p["metadata"]["name"] == "pdd-default-deny-ingress")
        assert "ingress" not in deny["spec"] and deny["spec"]["policyTypes"] == ["Ingress"]
        for role, t in pod_templates(objs).items():
            mine = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].get("pdd.sglang.ai/role") == role]
            rules = [rule for p in mine for rule in p["spec"].get("ingress", [])]
            for port in t["spec"]["containers"][0]["ports"]:
                n = port["containerPort"]
                opened = [rule for rule in rules if not rule.get("ports") or any(
                    p["port"] <= n <= p.get("endPort", p["port"]) for p in rule["ports"])]
                assert opened, (overlay, role, port)
                if role != "router":  # only the router's client port is open to every source
                    assert all(rule.get("from") for rule in opened), (overlay, role, port)


@needs_kubectl
def test_secrets_are_mounted_as_files_only_their_owner_may_read():
    for overlay in OVERLAYS:
        for role, t in pod_templates(render(overlay)).items():
            spec = t["spec"]
            assert "fsGroup" not in (spec.get("securityContext") or {})  # it would make them 0440
            secrets = [v for v in spec["volumes"] if "secret" in v]
            assert secrets and all(v["secret"]["defaultMode"] & 0o077 == 0 for v in secrets), (overlay, role)


def test_the_servers_accept_a_key_in_the_kubelets_secret_layout_and_refuse_what_fsgroup_makes(tmp_path):
    """A secret volume is ``KEY -> ..data/KEY``, ``..data -> ..<timestamp>/``; the file's mode is
    defaultMode (fsGroup adds group read). The servers check the mode of the file opened, past
    the symlinks."""
    from sglang_pdd.kv_channel.handshake import KeyFileError, load_key

    stamped = tmp_path / "..2026_12_07_00_00_00.000000001"
    stamped.mkdir()
    (stamped / "wan.key").write_text("k" * 64)
    os.symlink(stamped.name, tmp_path / "..data")
    os.symlink("..data/wan.key", tmp_path / "wan.key")
    os.chmod(stamped / "wan.key", 0o400)
    assert load_key(tmp_path / "wan.key") == b"k" * 64
    os.chmod(stamped / "wan.key", 0o440)
    with pytest.raises(KeyFileError, match="0440"):
        load_key(tmp_path / "wan.key")


@needs_kubectl
def test_the_routers_account_may_watch_pods_in_its_namespace_and_md_readers_in_cluster_b():
    for overlay, account, role in (("cluster-a-plain", "pdd-router", "pdd-router-discovery"),
                                   ("cluster-b-statefulset", "pdd-md-reader", "pdd-md-reader")):
        objs = render(overlay)
        rule = next(o for o in objs if o["kind"] == "Role" and o["metadata"]["name"] == role)["rules"][0]
        assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
        binding = next(o for o in objs if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == role)
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "sglang-pdd"}]
    assert pod_templates(render("cluster-a-plain"))["router"]["spec"]["serviceAccountName"] == "pdd-router"


def test_vendoring_a_crd_keeps_its_schema_and_drops_only_descriptions(tmp_path):
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "spec": {"group": "example.io", "names": {"kind": "Thing"}, "versions": [
               {"name": "v1", "served": True, "schema": {"openAPIV3Schema": {
                   "type": "object", "description": "a thing", "properties": {
                       "spec": {"type": "object", "properties": {"description": {"type": "string"}}}}}}},
               {"name": "v0", "served": False, "schema": {"openAPIV3Schema": {"type": "object"}}}]}}
    (tmp_path / "crd.yaml").write_text(yaml.safe_dump(crd))
    subprocess.run([sys.executable, str(REPO / "scripts" / "vendor_crd_schemas.py"), str(tmp_path / "crd.yaml"),
                    "--out", str(tmp_path)], check=True, capture_output=True)
    assert json.loads((tmp_path / "thing-example.io-v1.json").read_text()) == {
        "type": "object", "properties": {"spec": {"type": "object", "properties": {"description": {"type": "string"}}}}}
    assert not (tmp_path / "thing-example.io-v0.json").exists()
