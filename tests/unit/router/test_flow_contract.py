"""PddFlow against the fakes: the resume contract on every leg, SGLang's logprob extras and
``output_meta``, and what a client must not control: backend rids, room ids,
``pdd_*`` custom params, the WAN peer."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import aiohttp
import pytest

from tests.support.fake_backends import Fakes, Knobs, fake_logprob, truth, wait_until
from sglang_pdd.router.flow.pdd_flow import PddFlow, client_sampling, new_room
from sglang_pdd.router.flow.request import FlowRequest
from sglang_pdd.router.flow.pick import FlowShared, ServerPick
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.protocol import KvSize
from sglang_pdd.router.policy import Path
from tests.support.flow_scenarios import (PROMPT, assert_handed_off, assert_invariants, emitted_at_least,
                                         flow_config, p_md_cfg, scenario, takeover)

pytestmark = pytest.mark.timeout(60)

LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}


def expected_entry(pos: int, max_new: int) -> list:
    out = truth(PROMPT, max_new)
    return [fake_logprob(PROMPT + out[:pos], out[pos]), out[pos], None]


def assert_logprobs_complete(run, max_new: int) -> None:
    meta = run.flow.output_meta
    assert meta["output_token_logprobs"] == [expected_entry(i, max_new) for i in range(max_new)]
    assert meta["output_top_logprobs"] == [[expected_entry(i, max_new)] * 2 for i in range(max_new)]
    assert meta["input_token_logprobs"][0] == [None, PROMPT[0], None] and len(meta["input_token_logprobs"]) == len(PROMPT)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(PROMPT)
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == max_new
    assert meta["finish_reason"] == {"type": "length", "length": max_new}
    if run.flow.extras.get("token_ids_logprob") is None:
        assert "output_token_ids_logprobs" not in meta  # not asked for


# ---------------------------------------------------------------------- resume contract + logprobs
def test_one_shot_handoff_md_continues_with_total_budget_and_logprobs_are_spliced():
    knobs = Knobs()
    run = scenario(knobs, max_new=30, gates=takeover(knobs, 6), extras=LOGPROBS)
    assert_invariants(run, 30)
    final = assert_handed_off(run, 30)
    assert {k: final[k] for k in LOGPROBS} == LOGPROBS and final["stream"] is True
    # MD could not give the eager positions' logprobs: RLD's are spliced in
    assert_logprobs_complete(run, 30)
    for server in ("p", "rld"):
        body = run.fakes.records(server, "generate")[0].body
        assert {k: body[k] for k in LOGPROBS} == LOGPROBS


def test_md_burst_reporting_from_position_zero_is_stitched_after_the_cut():
    knobs = Knobs(md_burst=True)
    run = scenario(knobs, max_new=25, gates=lambda run: setattr(knobs, "md_before_ready", emitted_at_least(run, 4)),
                   extras=LOGPROBS)
    assert_invariants(run, 25)
    assert_handed_off(run, 25)
    assert_logprobs_complete(run, 25)


def test_md_death_mid_stream_recovery_leg_resumes_and_logprobs_stay_complete():
    knobs = Knobs(md_die_after=5, md_token_delay_s=0.005)
    run = scenario(knobs, max_new=40, gates=lambda run: setattr(knobs, "md_before_ready", emitted_at_least(run, 6)),
                   extras=LOGPROBS)
    assert_invariants(run, 40)
    legs = run.fakes.records("rld", "generate")
    assert len(legs) == 2 and legs[1].body["return_logprob"] is True
    assert_logprobs_complete(run, 40)


@pytest.mark.parametrize("mode", ["resume", "replay", "continue", "auto"])
def test_recovery_modes_after_md_dies_mid_stream(mode):
    knobs = Knobs(md_die_after=5, md_token_delay_s=0.005)
    cfg = dataclasses.replace(flow_config(), recovery=mode)
    run = scenario(knobs, max_new=40, cfg=cfg, extras=LOGPROBS,
                   gates=lambda run: setattr(knobs, "md_before_ready", emitted_at_least(run, 6)))
    assert_invariants(run, 40)
    r = run.flow.result
    resumed_at = r.handoff_at + 5
    body = run.fakes.records("rld", "generate")[1].body
    sampling, custom = body["sampling_params"], body["sampling_params"].get("custom_params")
    if mode == "resume":  # the resume contract: prompt + emitted, marker, total budget
        assert body["input_ids"] == PROMPT + truth(PROMPT, resumed_at)
        assert sampling["max_new_tokens"] == 40 and custom == {"pdd_resume_output_len": resumed_at}
    elif mode == "continue":  # the old way: a new request on prompt + emitted
        assert body["input_ids"] == PROMPT + truth(PROMPT, resumed_at)
        assert sampling["max_new_tokens"] == 40 - resumed_at and custom is None
    else:  # replay (auto picks it for greedy requests)
        assert body["input_ids"] == PROMPT and sampling["max_new_tokens"] == 40 and custom is None
    assert r.recovery_mode == (None if mode == "resume" else "replay" if mode == "auto" else mode)
    assert_logprobs_complete(run, 40)


def test_auto_recovery_continues_a_sampled_request():
    knobs = Knobs(md_die_after=5, md_token_delay_s=0.005)
    run = scenario(knobs, max_new=30, sampling={"temperature": 0.7},
                   gates=lambda run: setattr(knobs, "md_before_ready", emitted_at_least(run, 6)))
    assert_invariants(run, 30)  # the fakes are deterministic whatever the temperature
    assert run.flow.result.recovery_mode == "continue"


def test_a_replay_that_diverges_fails_the_request_instead_of_splicing_two_outputs():
    knobs = Knobs(md_die_after=5, md_token_delay_s=0.005, rld_diverge_legs=(2,))
    run = scenario(knobs, max_new=30, gates=lambda run: setattr(knobs, "md_before_ready", emitted_at_least(run, 6)))
    assert_invariants(run, 30, complete=False)
    assert run.error is not None and "diverged" in str(run.error)
    assert run.emitted == truth(PROMPT, len(run.emitted))  # nothing from the diverged leg


def test_p_md_recovery_leg_after_wan_failure():
    run = scenario(Knobs(md_ready="never"), max_new=20, cfg=p_md_cfg(), extras=LOGPROBS)
    assert_invariants(run, 20)
    legs = run.fakes.records("rld", "generate")
    assert legs[0].body["sampling_params"]["max_new_tokens"] == 1
    assert legs[1].body["input_ids"] == PROMPT and legs[1].body["sampling_params"]["max_new_tokens"] == 20
    assert_logprobs_complete(run, 20)


# ---------------------------------------------------------------------- the prompt's logprobs (P's reply)
TOKEN_IDS = {**LOGPROBS, "token_ids_logprob": [3, 5]}


def test_prompt_logprobs_come_from_ps_reply_on_every_path_and_token_ids_entry_of_ps_token_is_spliced():
    for path, cfg in (("p_rld_md", flow_config()), ("p_md", p_md_cfg()), ("p_rld_only", flow_config())):
        knobs = Knobs()
        run = scenario(knobs, max_new=12, cfg=cfg, extras=TOKEN_IDS, force_path=Path(path),
                       gates=takeover(knobs, 4) if path == "p_rld_md" else None)
        assert_invariants(run, 12)
        assert_logprobs_complete(run, 12)
        meta = run.flow.output_meta
        assert meta["input_token_ids_logprobs"][0] is None and len(meta["input_token_ids_logprobs"]) == len(PROMPT)
        # RLD has no token-ids entry for P's first token: P's reply fills position 0
        assert meta["output_token_ids_logprobs"] == [[expected_entry(i, 12)] for i in range(12)], path


def p_replies_after_rld_token(knobs: Knobs, n: int) -> None:
    """P's reply comes only once RLD is about to stream its token ``n`` (P's reply and RLD's
    first tokens race on real servers)."""
    gate = asyncio.Event()

    async def before_token(leg, i):
        if i == n:
            gate.set()

    async def before_reply(body):
        await gate.wait()

    knobs.rld_before_token, knobs.p_before_reply = before_token, before_reply


@pytest.mark.parametrize("asked", [True, False])
def test_the_first_output_waits_for_ps_reply_only_when_logprobs_are_asked_for(asked):
    knobs = Knobs()
    p_replies_after_rld_token(knobs, 3)
    run = scenario(knobs, max_new=10, force_path=Path.P_RLD_ONLY, extras=LOGPROBS if asked else None)
    assert_invariants(run, 10)
    replied = run.fakes.records("p", "reply")[0].t
    if asked:  # held back until the prompt's logprobs are in
        assert run.first_chunk_t >= replied and len(run.flow.output_meta["input_token_logprobs"]) == len(PROMPT)
        assert_logprobs_complete(run, 10)
    else:
        assert run.first_chunk_t < replied


@pytest.mark.parametrize("fault", ["no_lists", "p_error"])
def test_a_request_p_gave_no_prompt_logprobs_for_fails_instead_of_returning_less(fault):
    knobs = Knobs(p_logprobs=False) if fault == "no_lists" else Knobs(p_status=500)
    run = scenario(knobs, max_new=8, force_path=Path.P_RLD_ONLY, extras=LOGPROBS)
    assert run.error is not None and run.emitted == []
    if fault == "no_lists":
        assert "input_token_logprobs" in str(run.error)
    assert run.fakes.aborted_rids("rld")  # the relay leg is stopped


def test_a_recovery_leg_does_not_score_the_prompt_again():
    run = scenario(Knobs(md_ready="never"), max_new=10, cfg=p_md_cfg(), extras=LOGPROBS)
    assert_invariants(run, 10)
    legs = run.fakes.records("p", "generate")
    assert len(legs) == 2 and legs[0].body["logprob_start_len"] == 0 and legs[1].body["logprob_start_len"] == -1
    assert_logprobs_complete(run, 10)  # leg 1's P gave them


def test_p_md_bridge_leg_caps_min_new_tokens_to_its_one_token():
    knobs = Knobs()
    run = scenario(knobs, max_new=30, cfg=p_md_cfg(), gates=takeover(knobs, 0), sampling={"min_new_tokens": 10})
    assert_invariants(run, 30)
    assert run.fakes.records("rld", "generate")[0].body["sampling_params"]["min_new_tokens"] == 1
    final = assert_handed_off(run, 30)
    assert final["sampling_params"]["min_new_tokens"] == 10  # MD counts the eager token as output


def test_md_restarting_instead_of_continuing_is_refused_and_rld_finishes():
    knobs = Knobs(md_restarts=True)
    run = scenario(knobs, max_new=30, gates=lambda run: setattr(knobs, "md_before_ready", emitted_at_least(run, 4)))
    assert_invariants(run, 30)
    assert run.fallbacks == ["md_failed"] and "resume contract" in run.flow.result.fallbacks[0].detail
    assert run.flow.result.md_tokens == 0


def test_output_meta_without_logprobs_has_usage_and_finish_only():
    run = scenario(Knobs(md_ready="failed"), max_new=12)
    assert_invariants(run, 12)
    assert run.flow.output_meta == {"finish_reason": {"type": "length", "length": 12},
                                    "prompt_tokens": len(PROMPT), "completion_tokens": 12}


def test_unknown_extra_fields_are_refused():
    with pytest.raises(ValueError, match="n"):
        PddFlow(FlowRequest(PROMPT, {}, extras={"n": 2}), ServerPick(PrefillBackend("http://x", 1), "http://y"),
                flow_config(), FlowShared(None))


# ---------------------------------------------------------------------- what a client must not control
def test_room_ids_do_not_follow_the_random_module():
    random.seed(1234)
    first = new_room()
    random.seed(1234)
    assert new_room() != first  # a CSPRNG, not random.randint
    assert 0 <= first < 2**63


def test_client_pdd_custom_params_never_reach_a_backend():
    hostile = {"pdd_wan_peer": "10.9.9.9:1", "pdd_room": 7, "pdd_md_prefix_len": 0, "pdd_wan_expected": True,
               "pdd_resume_output_len": 3, "app_key": "kept"}
    assert client_sampling({"custom_params": hostile}) == {"custom_params": {"app_key": "kept"}}
    for cfg, path in ((flow_config(), None), (flow_config(), Path.P_RLD_ONLY), (p_md_cfg(), None)):
        knobs = Knobs()
        run = scenario(knobs, max_new=10, cfg=cfg, force_path=path, sampling={"custom_params": hostile})
        assert_invariants(run, 10)
        bodies = ([r.body for r in run.fakes.records("p", "generate")] + [r.body for r in run.fakes.records("rld", "generate")]
                  + [r.body for r in run.fakes.records("md", "handoff")] + [r.body for r in run.fakes.records("md", "warmup")])
        assert bodies
        for body in bodies:
            custom = body["sampling_params"].get("custom_params") or {}
            assert custom.get("app_key") == "kept"
            assert custom.get("pdd_wan_peer") in (None, "127.0.0.1:1")  # only the router's configured MD peer
            assert custom.get("pdd_room") != 7 and custom.get("pdd_resume_output_len") != 3
            assert not (path is Path.P_RLD_ONLY and any(k.startswith("pdd_") for k in custom))


def test_malformed_custom_params_are_refused():
    with pytest.raises(ValueError, match="custom_params"):
        client_sampling({"custom_params": ["pdd_room", 1]})


def test_colliding_client_rids_do_not_abort_each_others_legs():
    """Two clients send rid "dup"; one goes away mid-stream. The other's legs keep running."""
    knobs = Knobs(md_ready="never", rld_token_delay_s=0.01)

    async def main():
        fakes = await Fakes(knobs).start()
        session = aiohttp.ClientSession()
        try:
            def make() -> PddFlow:
                return PddFlow(FlowRequest(PROMPT, {"max_new_tokens": 40}, rid="dup"),
                               ServerPick(PrefillBackend(fakes.p_url, 8998), fakes.rld_url,
                                     MainBackend(fakes.md_url, fakes.md_url, "127.0.0.1:1")),
                               flow_config(), FlowShared(session))
            quitter, stayer = make(), make()

            async def quit_early():
                events = quitter.events()
                async for _ in events:
                    break
                await events.aclose()  # the client disconnects: its legs are aborted

            async def stay():
                got = []
                async for tokens in stayer.events():
                    got += tokens
                return got

            _, got = await asyncio.gather(quit_early(), stay())
            rids = [r.body["rid"] for r in fakes.records("rld", "generate")]
            assert len(set(rids)) == 2 and not any(rid.startswith("dup") for rid in rids)
            assert quitter.result.rid == stayer.result.rid == "dup"  # the client's own id, for its response
            await wait_until(lambda: fakes.rld_active == 0, timeout_s=5)
            return got
        finally:
            await session.close()
            await fakes.stop()

    assert asyncio.run(main()) == truth(PROMPT, 40)


def test_path_choice_uses_rlds_load_and_ps_queue_when_no_fixed_wan_budget_is_set():
    """Without --max-wan-transfer-ms the router passes RLD's load and P's prefill tokens in
    flight to the policy. Relay-first: an idle RLD hides the WAN (P->RLD->MD), a saturated one
    lets a fully cached prompt go P->MD. Fit: the fully cached prompt goes P->MD with RLD idle
    too, unless P's queue already eats the TTFT budget."""
    from sglang_pdd.router.policy import PathMode, PathPolicyConfig

    def decide(mode: PathMode, inflight: int, p_queued: int = 0):
        path = PathPolicyConfig(ttft_slo_ms=2000, wan_gbps=10, wan_rtt_ms=2, max_wan_transfer_ms=None, mode=mode,
                                p_prefill_tokens_per_s=1000.0)
        cfg = dataclasses.replace(flow_config(), path=path, rld_max_running=4)
        main = MainBackend("http://md", "http://md-control", "127.0.0.1:1")
        pick = ServerPick(PrefillBackend("http://x", 1), "http://y", main, rld_inflight=inflight, p_queued_tokens=p_queued,
                      md_kv_size=KvSize(512))
        flow = PddFlow(FlowRequest(PROMPT, {"max_new_tokens": 8}), pick, cfg, FlowShared(None))
        return flow._decide(md_cached=len(PROMPT))

    assert decide(PathMode.RELAY_FIRST, 0).path is Path.P_RLD_MD
    assert decide(PathMode.RELAY_FIRST, 8).path is Path.P_MD
    assert decide(PathMode.FIT, 0).path is Path.P_MD
    assert decide(PathMode.FIT, 0, p_queued=1900).path is Path.P_RLD_MD  # 1.9 s of P's queue: no budget left
