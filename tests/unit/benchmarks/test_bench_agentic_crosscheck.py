"""bench_agentic's cross-check counts on MD only the requests MD registered: an outlier the
router sent P->RLD on its length alone never reaches MD."""

from benchmarks.bench_agentic import Record, summarize


def record(kind, path, registration, prompt, cached=0):
    return Record("pdd", kind, 0, 0, prompt, 4, completion_tokens=4, path=path, md_registration=registration,
                  md_cached_tokens=cached)


def test_md_prompt_tokens_exclude_requests_md_never_registered():
    records = [record("session", "p_rld_md", "concurrent", 100, cached=40),
               record("session", "p_md", "before_legs", 60, cached=50),
               record("outlier", "p_rld_only", "none", 1500)]
    md_delta = {"prompt_tokens": 160, "cached_tokens": 90, "wan_bytes": 0}
    s = summarize(records, md_delta, {"pdd:wan_bytes_total": 0, "pdd:wan_bytes_saved_total": 0})
    assert s["crosscheck"]["md_prompt_tokens"] == (160, 160)
    assert s["crosscheck_ok"]
    # MD having counted the outlier would be a mismatch the cross-check reports.
    s = summarize(records, dict(md_delta, prompt_tokens=1660), {"pdd:wan_bytes_total": 0,
                                                                "pdd:wan_bytes_saved_total": 0})
    assert not s["crosscheck_ok"]
