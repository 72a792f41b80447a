"""The router's service-discovery flags and the discovery they build (docs/kubernetes.md).

    --service-discovery --prefill-selector app=sglang pdd.sglang.ai/role=prefill \\
        --relay-selector app=sglang pdd.sglang.ai/role=relay \\
        (--main-selector ... [--main-discovery-kubeconfig B.yaml] | --main-discovery-file md.json)

P and RLD come from the pods of this cluster (in a pod: its service account; else a kubeconfig).
MD comes from the same watch (one cluster), from a second cluster's API
(``--main-discovery-kubeconfig`` / ``--main-discovery-context``), or from a JSON/YAML file
reloaded on change (``--main-discovery-file``). Static ``--prefill`` / ``--relay`` / ``--main``
keep working beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Optional

from sglang_pdd.router.backends import kv_senders
from sglang_pdd.router.discovery.pods import DiscoveryState, Selector, SelectorError
from sglang_pdd.router.discovery.apply import Discovery, Membership
from sglang_pdd.router.discovery.watch import FileWatcher, PodWatcher, endpoint_for

logger = logging.getLogger(__name__)


def _selector(value: str) -> str:
    try:
        Selector.parse(value)
    except SelectorError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("service discovery on Kubernetes (docs/kubernetes.md)")
    g.add_argument("--service-discovery", action="store_true",
                   help="find P, RLD (and MD) as pods by label, as SMG does: only Ready pods, each role's ports from "
                        "its annotations; a pod that goes is drained (its requests finish), a new one joins after "
                        "the router's /health check; --prefill/--relay/--main may be left out or added to")
    for role, what in (("prefill", "P (annotation sglang.ai/bootstrap-port; pdd.sglang.ai/control-port optional)"),
                       ("relay", "RLD"),
                       ("main", "MD (annotations pdd.sglang.ai/control-port, pdd.sglang.ai/wan-port)")):
        g.add_argument(f"--{role}-selector", nargs="+", type=_selector, default=None, metavar="K=V",
                       help=f"labels of the {what} pods, all equal (SMG's matching); a pod matching two roles' "
                            f"selectors is refused")
    g.add_argument("--service-discovery-namespace", default=None, metavar="NS",
                   help="namespace watched (default: every namespace, which needs cluster-wide list/watch RBAC)")
    g.add_argument("--service-discovery-port", type=int, default=30000,
                   help="the SGLang HTTP port of a discovered pod (annotation pdd.sglang.ai/http-port overrides)")
    g.add_argument("--service-discovery-kubeconfig", default=None, metavar="PATH",
                   help="kubeconfig of the cluster holding P and RLD (default: the pod's service account, else "
                        "$KUBECONFIG)")
    g.add_argument("--service-discovery-context", default=None, metavar="NAME", help="its context")
    g.add_argument("--main-discovery-kubeconfig", default=None, metavar="PATH",
                   help="kubeconfig of the cluster holding MD (datacenter B): --main-selector is watched there")
    g.add_argument("--main-discovery-context", default=None, metavar="NAME",
                   help="context of MD's cluster (in --main-discovery-kubeconfig, else in the default kubeconfig)")
    g.add_argument("--main-discovery-namespace", default=None, metavar="NS",
                   help="namespace watched in MD's cluster (default: --service-discovery-namespace)")
    g.add_argument("--main-discovery-file", default=None, metavar="PATH",
                   help="MD's list as a JSON or YAML file, [{url, control_url, wan}, ...], reloaded when it changes "
                        "(a file that does not parse is logged and the last good list kept)")


def main_elsewhere(args) -> bool:
    return bool(args.main_discovery_kubeconfig or args.main_discovery_context)


def check_args(args) -> Optional[str]:
    """An error message for a flag combination that cannot work, else None."""
    if not args.service_discovery:
        given = [f for f, v in (("--prefill-selector", args.prefill_selector), ("--relay-selector", args.relay_selector),
                                ("--main-selector", args.main_selector)) if v]
        if given or main_elsewhere(args):
            return f"{', '.join(given) or '--main-discovery-*'} need --service-discovery"
        if not args.prefill or not args.relay:
            return "--prefill and --relay are required (or --service-discovery with --prefill-selector and " \
                   "--relay-selector)"
        return None
    if not (args.prefill or args.prefill_selector) or not (args.relay or args.relay_selector):
        return "--service-discovery needs --prefill-selector (or --prefill) and --relay-selector (or --relay)"
    if main_elsewhere(args) and not args.main_selector:
        return "--main-discovery-kubeconfig/--main-discovery-context need --main-selector"
    if args.main_selector and args.main_discovery_file:
        return "MD comes from --main-selector or --main-discovery-file, not both"
    return None


def may_find_main(args) -> bool:
    return bool(args.main_selector or args.main_discovery_file)


def build(args, router) -> Optional[Discovery]:
    """The discovery the flags ask for, bound to ``router``'s pools (None: no discovery flags)."""
    if not (args.service_discovery or args.main_discovery_file):
        return None
    pools = router.pools

    def joined(role: str, entry) -> None:
        if role == "main":
            from sglang_pdd.router.front.app import learn_md_kv_sizes

            asyncio.ensure_future(learn_md_kv_sizes(router.session, [entry], pools))
            if router._kv_senders is None:  # the first MD: P hosts announced from now on (backends/kv_senders.py)
                router._kv_senders = asyncio.ensure_future(
                    kv_senders.announce_forever(router.session, pools.main, pools.prefill))
                return
        if role in ("main", "prefill") and pools.main:  # a new P or MD: MD learns the P hosts now
            async def announce_now():
                await kv_senders.announce(router.session, pools.main, await kv_senders.p_addresses(pools.prefill))

            asyncio.ensure_future(announce_now())

    membership = Membership(pools, lambda: router.session, track=router.metrics.track_backend, joined=joined,
                            https_control_only=bool(args.control_tls_cert))
    watchers: list = []
    if args.service_discovery:
        here = {role: Selector.parse(sel) for role, sel in (("prefill", args.prefill_selector),
                                                             ("relay", args.relay_selector),
                                                             ("main", None if main_elsewhere(args) else args.main_selector))
                if sel}
        if here:
            endpoint = endpoint_for(args.service_discovery_kubeconfig, args.service_discovery_context)
            watchers.append(PodWatcher(endpoint, args.service_discovery_namespace,
                                       DiscoveryState(here, args.service_discovery_port), membership.apply,
                                       name="P/RLD" + ("/MD" if "main" in here else "")))
        if main_elsewhere(args):
            endpoint = endpoint_for(args.main_discovery_kubeconfig, args.main_discovery_context)
            watchers.append(PodWatcher(endpoint, args.main_discovery_namespace or args.service_discovery_namespace,
                                       DiscoveryState({"main": Selector.parse(args.main_selector)},
                                                      args.service_discovery_port), membership.apply, name="MD"))
    if args.main_discovery_file:
        watchers.append(FileWatcher(args.main_discovery_file, membership.apply))
    return Discovery(membership, watchers)
