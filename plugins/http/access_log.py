"""One access-log line per generation: status, token counts, TTFT (queue wait included), rates."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("superfluid.access")


def log_generation(request, *, status: int, model: str, qos: str, prompt_tokens: int,
                   completion_tokens: int, timings: dict, finish: str | None, arrived: float) -> None:
    now = time.monotonic()
    first = timings.get("first_token_at")
    finished = timings.get("finished_at") or now
    parts = [f'{request.remote} "{request.method} {request.path}" {status}', f"model={model}",
             f"qos={qos}", f"prompt={prompt_tokens}", f"completion={completion_tokens}"]
    if first is not None:
        ttft = first - arrived
        parts.append(f"ttft={ttft:.3f}s")
        parts.append(f"prefill={prompt_tokens / max(ttft, 1e-6):.1f}t/s")
        if completion_tokens > 1:
            parts.append(f"decode={(completion_tokens - 1) / max(finished - first, 1e-6):.1f}t/s")
    else:
        parts.append("ttft=-")
    parts.append(f"total={finished - arrived:.3f}s")
    parts.append(f"finish={finish or '-'}")
    log.info(" ".join(parts))
