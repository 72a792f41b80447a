"""Vendors the openAPIV3Schema of the RoleBasedGroup and LeaderWorkerSet CRDs into
deploy/kubernetes/crd-schemas/ (JSON, "description" fields dropped: they are most of the bytes
and validate nothing), for tests/unit/deploy/test_kubernetes_manifests.py.

    python scripts/vendor_crd_schemas.py RBG_CRD.yaml LWS_CRD.yaml [--out DIR]

(the CRD files from sgl-project/rbg and kubernetes-sigs/lws at the commits named in
deploy/kubernetes/crd-schemas/README.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "crd-schemas"


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description" or not isinstance(v, str)}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(argv: list[str]) -> None:
    out_dir = OUT
    if "--out" in argv:
        i = argv.index("--out")
        out_dir, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    for path in argv:
        crd = yaml.safe_load(Path(path).read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if not version.get("served"):
                continue
            out = out_dir / f"{kind.lower()}-{group}-{version['name']}.json"
            out.write_text(json.dumps(strip(version["schema"]["openAPIV3Schema"]), sort_keys=True) + "\n")
            print(f"{out}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
