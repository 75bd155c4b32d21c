"""How the chaos suite's reloads_under_load sorts the load tool's answers: whole only with a
finish_reason, refusals only with a documented code and Retry-After, a stream's error event only
with model_unloaded; everything else counted undocumented, lost ones left to the load tool."""

from __future__ import annotations

from tools.bench.load import Result
from tools.chaos.scenarios.reloads_under_load import classify

REPORT = {"requests": 0, "lost": 0, "lost_reasons": {}, "statuses": {},
          "latency_s": {"all_p50": 0.5, "all_p99": 1.0}}


def _r(status, **kw) -> Result:
    return Result(client=0, key="load-0", kind="chat", status=status, latency=0.1, **kw)


def test_classify_counts_documented_and_undocumented_answers():
    results = [
        _r(200, finished=True),                                             # whole
        _r(200, finished=True, stream_error=True, code="model_unloaded"),   # unload's last event
        _r(503, code="model_unloaded", retry_after=True),
        _r(429, code="rate_limit_exceeded", retry_after=True),
        _r(429, code="too_many_concurrent_requests", retry_after=True),
        _r(429, code="queue_full", retry_after=True),
        _r(200),                                                            # no finish_reason
        _r(200, stream_error=True, code="engine_error"),
        _r(503, code="model_unloaded"),                                     # no Retry-After
        _r(401, code="invalid_api_key"),
        _r(500, code="engine_error"),
        _r(None, lost="timeout"),                                           # the load tool's
    ]
    out = classify(dict(REPORT, requests=len(results), lost=1, lost_reasons={"timeout": 1}), results)
    assert (out["whole"], out["documented"], out["undocumented"], out["lost"]) == (1, 5, 5, 1)
    assert out["refusals"] == {"stream error model_unloaded": 1, "503 model_unloaded": 1,
                               "429 rate_limit_exceeded": 1, "429 too_many_concurrent_requests": 1,
                               "429 queue_full": 1}
    assert out["undocumented_kinds"] == {"no finish_reason": 1, "stream error engine_error": 1,
                                         "503 model_unloaded without Retry-After": 1,
                                         "401 invalid_api_key": 1,
                                         "500 engine_error": 1}
    assert out["saw_model_unloaded"] == 2
