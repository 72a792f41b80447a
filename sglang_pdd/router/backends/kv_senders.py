"""Telling each MD which P hosts send it KV, so that MD's WAN receiver counts them as known
peers (kv_channel/acceptor.py, sglang_pdd/admission.py): a keyless flood that fills the
handshake slots left to unknown sources cannot keep a P out, even one MD has not heard from
since it started. The router knows its P hosts from its configuration (``--prefill``); it
resolves their host names and posts the addresses to every MD's control API (signed, as
every control call), at start and every ``interval_s``, so a restarted MD learns them again
within that.

What MD learns is the address of each P's URL: a P whose WAN connections leave from another
address (another interface) is still to be listed in MD's ``--pdd-kv-trusted-sources``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Iterable, Sequence

import aiohttp

from sglang_pdd.protocol import KvSendersReply, KvSendersRequest
from sglang_pdd.protocol import routes as api
from sglang_pdd.router.backends.clients import BackendError, MainControl, _call_json
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend

logger = logging.getLogger(__name__)

ANNOUNCE_EVERY_S = 30.0
RETRY_S = 2.0  # while an MD has not taken them (starting up, restarting)


async def p_addresses(prefills: Iterable[PrefillBackend]) -> list[str]:
    """The IP addresses of the P hosts (their URLs' host names resolved), sorted, each once."""
    loop = asyncio.get_running_loop()
    found: set[str] = set()
    for host in sorted({p.host for p in prefills}):
        try:
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as e:
            logger.warning("P host %s does not resolve (%s): MD will not count it as a known KV peer", host, e)
            continue
        found.update(info[4][0].split("%", 1)[0] for info in infos)
    return sorted(found)


async def announce(session: aiohttp.ClientSession, mains: Sequence[MainBackend], sources: list[str],
                   timeout_s: float = 10.0) -> dict[str, bool]:
    """Post ``sources`` to every MD's control API; whether each MD (by control URL) took them."""
    body = KvSendersRequest(tuple(sources)).to_json()

    async def one(main: MainBackend) -> bool:
        mc = MainControl(session, main.control_url)
        try:
            reply = await _call_json(session, api.MD_KV_SENDERS.method, mc.url + api.MD_KV_SENDERS.path(),
                                     "MD kv_senders", json=body, timeout_s=timeout_s, signer=mc.signer, tls=mc.tls)
            return KvSendersReply.from_json(reply).known == len(sources)
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            logger.debug("MD %s did not take the P hosts: %s", main.control_url, e)
            return False

    mains = [m for m in mains if m.control_url]
    return dict(zip((m.control_url for m in mains), await asyncio.gather(*(one(m) for m in mains))))


async def announce_forever(session: aiohttp.ClientSession, mains: Sequence[MainBackend],
                           prefills: Sequence[PrefillBackend], interval_s: float = ANNOUNCE_EVERY_S,
                           retry_s: float = RETRY_S) -> None:
    """``announce`` at start and every ``interval_s``, every ``retry_s`` while an MD has not
    taken them (it may still be starting); logged once per MD that has not, after a minute."""
    failing: dict[str, int] = {}
    while True:
        sources = await p_addresses(prefills)
        for url, ok in (await announce(session, mains, sources)).items():
            if ok:
                failing.pop(url, None)
                continue
            failing[url] = failing.get(url, 0) + 1
            if failing[url] == max(1, round(60.0 / retry_s)):
                logger.warning("MD %s has not taken the P hosts %s as known KV peers for a minute (retrying)",
                               url, sources)
        await asyncio.sleep(retry_s if failing else interval_s)
