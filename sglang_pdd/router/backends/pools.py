"""The router's backend pools: P, RLD and MD servers, what the router knows of them (requests
in flight, cached prefixes, health) and the pick of one of each for a request (placement
policy: router/backends/placement.py; breakers: router/backends/health.py)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Optional

from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.backends.health import HealthBoard, HealthConfig
from sglang_pdd.router.backends.placement import InstanceLoad, MdMoveCost, pick_main, pick_prefill
from sglang_pdd.router.backends.prefix_index import PrefixIndex
from sglang_pdd.router.backends.wan_in_flight import WanInFlight


class NoBackend(Exception):
    """No server of a role the request needs may be picked now (breakers open, draining)."""


class Pools:
    """Backend pools and what the router knows of them: in-flight counts, cached prefixes and
    health (router/backends/health.py: breakers per server and per P-RLD pair, drain)."""

    def __init__(self, prefill: list[PrefillBackend], relay: list[str], main: list[MainBackend],
                 index_blocks_per_instance: int = 1 << 16, health: Optional[HealthConfig] = None,
                 md_move: Optional[MdMoveCost] = None, allow_empty: bool = False):
        # allow_empty: service discovery fills the pools once the pods are found
        if not allow_empty and (not prefill or not relay):
            raise ValueError("the router needs at least one --prefill and one --relay server")
        self.prefill, self.relay, self.main = prefill, relay, main
        self._rr = itertools.count()
        self.p_inflight = {p.url: 0 for p in prefill}
        # Prefill tokens in flight on each P (prompts less their expected cached prefix, until
        # P's leg replies): P's queue as the router sees it, what P is placed by.
        self.p_tokens = {p.url: 0 for p in prefill}
        self.rld_inflight = {url: 0 for url in relay}
        self.md_inflight = {m.url: 0 for m in main}
        self.wan = WanInFlight()  # one link between the datacenters, whichever MD a transfer goes to
        # Each MD's KV size (router/policy.py KvSize) as it last told it (its stats at start,
        # then each registration answer): a flow's route carries it, the WAN estimate of a path
        # chosen before MD answers; the default (md_move) until an MD has told.
        self.md_kv_sizes: dict = {}
        # Approximate prefix index (16-token blocks): P's and MD's cached prefixes.
        self.prefixes = PrefixIndex(index_blocks_per_instance, block_tokens=16)
        self.health = HealthBoard(health or HealthConfig())
        # What leaving the MD that holds a prefix costs (placement.pick_main): the WAN's rate and
        # the KV size until MD reports its own; each MD's step growth per flow as measured
        # (router/backends/loads.py), the default until then.
        self.md_move = md_move or MdMoveCost(kv_bytes_per_token=46_000, wan_bytes_per_s=10e9 / 8)
        self.md_flow_step_s = {m.url: self.md_move.flow_step_s for m in main}

    def roles(self) -> dict[str, list[str]]:
        return {"prefill": [p.url for p in self.prefill], "relay": list(self.relay), "main": [m.url for m in self.main]}

    def add(self, role: str, backend) -> None:
        """A backend joins its role's pool (service discovery): picked from now on. ``backend``: a
        PrefillBackend, a relay URL or a MainBackend."""
        url = backend if role == "relay" else backend.url
        if url in self.roles()[role]:
            raise ValueError(f"{role} backend {url} is in the pool already")
        {"prefill": self.prefill, "relay": self.relay, "main": self.main}[role].append(backend)
        for counts in ((self.p_inflight, self.p_tokens) if role == "prefill" else
                       (self.rld_inflight,) if role == "relay" else (self.md_inflight,)):
            counts.setdefault(url, 0)

    def remove(self, role: str, url: str) -> None:
        """A backend leaves its role's pool (drained first: nothing runs on it). Its counts stay
        (at 0): a flow that picked it just before cannot find its counter gone."""
        pool = {"prefill": self.prefill, "relay": self.relay, "main": self.main}[role]
        pool[:] = [b for b in pool if (b if role == "relay" else b.url) != url]
        self.prefixes.forget(url)

    def inflight(self) -> dict[str, dict[str, int]]:
        """Role -> {url: requests in flight}, the live counts (not copies)."""
        return {"prefill": self.p_inflight, "relay": self.rld_inflight, "main": self.md_inflight}

    def learn_md_kv_size(self, url: str, size, from_stats: bool = False) -> None:
        """MD ``url`` told its KV size (a KvSize): a registration answer replaces what the pools
        held; its stats at start (``from_stats``) only fill in a size not known yet."""
        if size is not None and size.per_token > 0 and not (from_stats and url in self.md_kv_sizes):
            self.md_kv_sizes[url] = size

    def pick(self, input_ids: list[int], now: Optional[float] = None, exclude: frozenset = frozenset(),
             max_new_tokens: Optional[int] = None) -> tuple[PrefillBackend, str, Optional[MainBackend]]:
        """P and MD by cached prefix with load balance, RLD by load; only servers (and P-RLD pairs)
        the health board lets through, none of the urls in ``exclude``. No P or no RLD:
        NoBackend. No MD: None (RLD serves). ``max_new_tokens``: the request's decode steps,
        what a busier MD costs it (None: placement's default)."""
        now = time.monotonic() if now is None else now

        def ok(key, now) -> bool:
            return key[-1] not in exclude and self.health.pickable(key, now)

        relays = [url for url in self.relay if ok(("relay", url), now)]
        if not relays:
            raise NoBackend("no relay decode server is available (every one is failing or draining)")
        # a P whose pairs with every available RLD are failing cannot serve either
        prefills = [p for p in self.prefill
                    if ok(("prefill", p.url), now) and any(ok(("pair", p.url, url), now) for url in relays)]
        if not prefills:
            raise NoBackend("no prefill server is available (every one is failing or draining, "
                            "or failing with every available relay decode server)")
        turn = next(self._rr) % len(prefills)  # equal candidates take turns
        prefill = self._pick_prefill(prefills[turn:] + prefills[:turn], input_ids)
        relays = [url for url in relays if ok(("pair", prefill.url, url), now)]
        relay = min(relays, key=lambda url: self.rld_inflight[url])  # least loaded RLD
        mains = [m for m in self.main if ok(("main", m.url), now)]
        main = self._pick_main(mains, input_ids, max_new_tokens) if mains else None
        return prefill, relay, main

    def _pick_prefill(self, servers: list, input_ids: list[int]):
        """placement.pick_prefill over P's tokens in flight; ties to the least loaded, then
        to the first in `servers` (rotated by the caller, so equal ones take turns)."""
        by_load = sorted(servers, key=lambda s: self.p_tokens[s.url])
        owner, matched = self.prefixes.best([s.url for s in by_load], input_ids)
        loads = [InstanceLoad(s.url, self.p_tokens[s.url]) for s in servers]
        chosen = pick_prefill(loads, owner if matched else None, matched)
        return next(s for s in servers if s.url == chosen)

    def count_on_p(self, url: str, tokens: int) -> None:
        """A request's prefill was sent to P `url`: `tokens` it is expected to compute."""
        self.p_inflight[url] += 1
        self.p_tokens[url] += tokens

    def prefill_replied(self, url: str, tokens: int, input_ids: list[int]) -> None:
        """P's leg replied (or the request ended first): its tokens are off P's queue, and P
        holds the prompt from now on (the next turn of a session may arrive before this one
        ends, and should find it)."""
        self.p_inflight[url] -= 1
        self.p_tokens[url] -= tokens
        self.prefixes.record(url, input_ids)

    def _pick_main(self, servers: list, input_ids: list[int], max_new_tokens: Optional[int]):
        """placement.pick_main over MD's flows in flight: the MD holding the longest cached
        prefix keeps the request unless its excess flows cost more than re-sending that prefix
        over the WAN; ties to the least loaded, then to the first in ``servers``."""
        inflight = self.md_inflight
        by_load = sorted(servers, key=lambda s: inflight[s.url])
        owner, matched = self.prefixes.best([s.url for s in by_load], input_ids)
        loads = [InstanceLoad(s.url, inflight[s.url]) for s in servers]
        cost = self.md_move
        if matched:
            # re-sending the prefix costs its full layers' KV (a sliding window is sent either way)
            size = self.md_kv_sizes.get(owner)
            cost = dataclasses.replace(cost,
                                       kv_bytes_per_token=size.per_token if size is not None else cost.kv_bytes_per_token,
                                       flow_step_s=self.md_flow_step_s.get(owner, cost.flow_step_s))
        chosen = pick_main(loads, owner if matched else None, matched, max_new_tokens, self.wan.transfers, cost)
        return next(s for s in servers if s.url == chosen)
