"""deploy/kubernetes's workload files from one pod template per role, so that the variants
(RoleBasedGroup or Deployments in cluster A; LeaderWorkerSet or StatefulSet in cluster B)
cannot drift apart.

    python scripts/gen_kubernetes_templates.py          # rewrite them
    python scripts/gen_kubernetes_templates.py --check  # exit 1 if one is not what this would write

tests/unit/deploy/test_kubernetes_manifests.py runs --check.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "overlays"

COMMON_ENV = """\
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: MODEL_PATH
  valueFrom: {configMapKeyRef: {name: pdd-params, key: MODEL_PATH}}
"""
# SGLang's /health: 503 while the weights load; then it decodes one token and answers after at
# least a second (up to its HEALTH_CHECK_TIMEOUT, 20 s): the probes wait 25 s, not kubelet's 1 s.
PROBES = """\
startupProbe:
  httpGet: {path: /health, port: http}
  periodSeconds: 10
  timeoutSeconds: 25
  failureThreshold: 180
readinessProbe:
  httpGet: {path: /health, port: http}
  periodSeconds: 10
  timeoutSeconds: 25
  failureThreshold: 2
livenessProbe:
  httpGet: {path: /health, port: http}
  periodSeconds: 20
  timeoutSeconds: 25
  failureThreshold: 4
"""
KEY_VOLUME = """\
- name: shared-key
  secret:
    secretName: pdd-shared-key
    defaultMode: 256   # 0400: the servers refuse a key file group or others may read
"""
SERVER_SPEC = """\
serviceAccountName: pdd-server
automountServiceAccountToken: false
terminationGracePeriodSeconds: 90
# no fsGroup: with one, kubelet makes secret files group-readable (0440) and the servers refuse the key
containers:
  - name: sglang
    image: sglang-pdd
    command: [python3, -m, sglang.launch_server]
    args: [ARGS]
    env:
ENV
      - name: SGLANG_HOST_IP   # the address this server's KV transfers use
        valueFrom: {fieldRef: {fieldPath: status.podIP}}
      - name: TP
        valueFrom: {configMapKeyRef: {name: pdd-params, key: TP}}
EXTRA_ENV
    ports:
PORTS
PROBES
    lifecycle:
      # the router drains this pod when its deletion starts (the watch's MODIFIED with a
      # deletion timestamp): requests already on it get this long before SIGTERM
      preStop: {sleep: {seconds: 30}}
    resources:
      requests: {cpu: "8", memory: 64Gi, nvidia.com/gpu: "1"}
      limits: {nvidia.com/gpu: "1"}
    volumeMounts:
      - {name: shared-key, mountPath: /etc/pdd/key, readOnly: true}
      - {name: dshm, mountPath: /dev/shm}
volumes:
KEY_VOLUME
  - name: dshm
    emptyDir: {medium: Memory, sizeLimit: 16Gi}
"""
ROLES = {
  "prefill": dict(
    annotations={"sglang.ai/bootstrap-port": "8998", "pdd.sglang.ai/control-port": "31000"},
    args=["--model-path", "$(MODEL_PATH)", "--host", "0.0.0.0", "--port", "30000", "--tp", "$(TP)",
          "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "pdd",
          "--disaggregation-bootstrap-port", "8998", "--pdd-role", "prefill", "--pdd-datacenter", "a",
          "--pdd-wan-key-file", "/etc/pdd/key/wan.key", "--pdd-wan-peers", "$(MD_WAN_PEERS)",
          "--pdd-control-listen", "$(POD_IP):31000"],
    extra_env="""\
- name: MD_WAN_PEERS
  valueFrom: {configMapKeyRef: {name: pdd-params, key: MD_WAN_PEERS}}
""",
    ports="""\
- {name: http, containerPort: 30000}
- {name: bootstrap, containerPort: 8998}
- {name: control, containerPort: 31000}
"""),
  "relay": dict(
    annotations={},
    args=["--model-path", "$(MODEL_PATH)", "--host", "0.0.0.0", "--port", "30000", "--tp", "$(TP)",
          "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "pdd",
          "--pdd-role", "relay", "--pdd-datacenter", "a", "--pdd-wan-key-file", "/etc/pdd/key/wan.key"],
    extra_env="",
    ports="- {name: http, containerPort: 30000}\n"),
  "main": dict(
    # the router and P dial MD by its per-pod Service under the multi-cluster DNS suffix
    annotations={"pdd.sglang.ai/control-port": "31002", "pdd.sglang.ai/wan-port": "17000",
                 "pdd.sglang.ai/advertise-host": "{pod}.{namespace}.svc.clusterset.local"},
    args=["--model-path", "$(MODEL_PATH)", "--host", "0.0.0.0", "--port", "30000", "--tp", "$(TP)",
          "--pdd-role", "main", "--pdd-datacenter", "b", "--pdd-wan-key-file", "/etc/pdd/key/wan.key",
          "--pdd-wan-listen", "$(POD_IP):17000", "--pdd-control-listen", "$(POD_IP):31002",
          "--pdd-control-names", "$(POD_NAME).$(POD_NAMESPACE).svc.clusterset.local"],
    extra_env="",
    ports="""\
- {name: http, containerPort: 30000}
- {name: control, containerPort: 31002}
- {name: wan, containerPort: 17000}
"""),
}
ROUTER = """\
serviceAccountName: pdd-router
terminationGracePeriodSeconds: 60
containers:
  - name: router
    image: sglang-pdd
    command: [python3, -m, sglang_pdd.router]
    args:
      - --host=0.0.0.0
      - --port=30300
      - --tokenizer-path=$(MODEL_PATH)
      - --served-model-name=$(SERVED_MODEL_NAME)
      - --control-key-file=/etc/pdd/key/wan.key
      - --operator-token-file=/etc/pdd/operator/token
      - --service-discovery
      - --service-discovery-namespace=$(POD_NAMESPACE)
      - --prefill-selector
      - app.kubernetes.io/part-of=sglang-pdd
      - pdd.sglang.ai/role=prefill
      - --relay-selector
      - app.kubernetes.io/part-of=sglang-pdd
      - pdd.sglang.ai/role=relay
      - --main-selector
      - app.kubernetes.io/part-of=sglang-pdd
      - pdd.sglang.ai/role=main
      # MD runs in cluster B: watched there with a kubeconfig of its pdd-md-reader account
      - --main-discovery-kubeconfig=/etc/pdd/cluster-b/kubeconfig
      - --main-discovery-namespace=$(MD_NAMESPACE)
      - --service-discovery-port=30000
    env:
ENV
      - name: SERVED_MODEL_NAME
        valueFrom: {configMapKeyRef: {name: pdd-params, key: SERVED_MODEL_NAME}}
      - name: MD_NAMESPACE
        valueFrom: {configMapKeyRef: {name: pdd-params, key: MD_NAMESPACE}}
    ports:
      - {name: http, containerPort: 30300}
    startupProbe:   # the serving layer loads the tokenizer
      httpGet: {path: /metrics, port: http}
      periodSeconds: 5
      failureThreshold: 60
    readinessProbe:  # 200 once a P and an RLD may be picked (discovered, health-checked)
      httpGet: {path: /health, port: http}
      periodSeconds: 5
      failureThreshold: 2
    livenessProbe:   # the process answers (not whether backends do)
      httpGet: {path: /metrics, port: http}
      periodSeconds: 15
      timeoutSeconds: 10
      failureThreshold: 4
    resources:
      requests: {cpu: "4", memory: 8Gi}
    volumeMounts:
      - {name: shared-key, mountPath: /etc/pdd/key, readOnly: true}
      - {name: operator-token, mountPath: /etc/pdd/operator, readOnly: true}
      - {name: cluster-b, mountPath: /etc/pdd/cluster-b, readOnly: true}
volumes:
KEY_VOLUME
  - name: operator-token
    secret: {secretName: pdd-operator-token, defaultMode: 256}
  - name: cluster-b
    secret: {secretName: pdd-cluster-b-kubeconfig, defaultMode: 256}
"""

def ind(text, n):
    return textwrap.indent(text, " " * n)

def role_spec(role):
    r = ROLES[role]
    args = "\n".join(f'      - "{a}"' for a in r["args"])  # quoted: every arg a string
    s = SERVER_SPEC.replace("    args: [ARGS]\n", "    args:\n" + args + "\n")
    s = s.replace("EXTRA_ENV\n", ind(r["extra_env"], 6)).replace("ENV\n", ind(COMMON_ENV, 6))
    s = s.replace("PORTS\n", ind(r["ports"], 6)).replace("PROBES\n", ind(PROBES, 4)).replace("KEY_VOLUME\n", ind(KEY_VOLUME, 2))
    return s

def router_spec():
    return ROUTER.replace("ENV\n", ind(COMMON_ENV, 6)).replace("KEY_VOLUME\n", ind(KEY_VOLUME, 2))

def metadata(role, annotations):
    s = f"metadata:\n  labels:\n    app.kubernetes.io/part-of: sglang-pdd\n    pdd.sglang.ai/role: {role}\n"
    if annotations:
        s += "  annotations:\n" + "".join(f"    {k}: \"{v}\"\n" for k, v in annotations.items())
    return s

def template(role):
    spec = router_spec() if role == "router" else role_spec(role)
    ann = {} if role == "router" else ROLES[role]["annotations"]
    return metadata(role, ann) + "spec:\n" + ind(spec, 2)

HEADER = "# Generated by scripts/gen_kubernetes_templates.py from one pod template per role: edit it there.\n"
REPLICAS = {"router": 2, "prefill": 2, "relay": 2, "main": 2}

def rbg():
    out = HEADER + "apiVersion: workloads.x-k8s.io/v1alpha2\nkind: RoleBasedGroup\nmetadata:\n  name: pdd-a\nspec:\n  roles:\n"
    for role in ("router", "prefill", "relay"):
        out += f"    - name: {role}\n      replicas: {REPLICAS[role]}\n"
        out += "      rolloutStrategy:\n        type: RollingUpdate\n        rollingUpdate: {maxUnavailable: 1, maxSurge: 0}\n"
        out += "      standalonePattern:\n        template:\n" + ind(template(role), 10)
    return out

def plain():
    docs = []
    for role in ("router", "prefill", "relay"):
        d = HEADER + f"apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: pdd-{role}\nspec:\n  replicas: {REPLICAS[role]}\n"
        d += "  strategy:\n    type: RollingUpdate\n    rollingUpdate: {maxUnavailable: 1, maxSurge: 0}\n"
        d += f"  selector:\n    matchLabels:\n      app.kubernetes.io/part-of: sglang-pdd\n      pdd.sglang.ai/role: {role}\n"
        d += "  template:\n" + ind(template(role), 4)
        docs.append(d)
    return "---\n".join(docs)


def md_leaderworkerset():
    return (HEADER + "apiVersion: leaderworkerset.x-k8s.io/v1\nkind: LeaderWorkerSet\nmetadata:\n  name: pdd-md\nspec:\n"
            f"  replicas: {REPLICAS['main']}\n  startupPolicy: LeaderCreated\n"
            "  rolloutStrategy:\n    type: RollingUpdate\n    rollingUpdateConfiguration: {maxUnavailable: 1, maxSurge: 0}\n"
            "  leaderWorkerTemplate:\n    size: 1   # one pod per MD (a multi-node MD: size N and a leaderTemplate)\n"
            "    workerTemplate:\n" + ind(template("main"), 6))


def md_statefulset():
    return (HEADER + "apiVersion: apps/v1\nkind: StatefulSet\nmetadata:\n  name: pdd-md\nspec:\n"
            f"  replicas: {REPLICAS['main']}\n  serviceName: pdd-md\n  podManagementPolicy: Parallel\n"
            "  updateStrategy:\n    type: RollingUpdate\n    rollingUpdate: {maxUnavailable: 1}\n"
            "  selector:\n    matchLabels:\n      app.kubernetes.io/part-of: sglang-pdd\n      pdd.sglang.ai/role: main\n"
            "  template:\n" + ind(template("main"), 4))


FILES = {"cluster-a-rbg/rolebasedgroup.yaml": rbg, "cluster-a-plain/deployments.yaml": plain,
         "cluster-b-lws/leaderworkerset.yaml": md_leaderworkerset,
         "cluster-b-statefulset/statefulset.yaml": md_statefulset}


def main(argv: list[str]) -> int:
    stale = []
    for name, make in FILES.items():
        path, text = DEPLOY / name, make()
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python scripts/gen_kubernetes_templates.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
