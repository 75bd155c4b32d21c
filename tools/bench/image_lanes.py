"""What a vision tower of a real size costs the lanes beside it, measured against running servers
(``tools.bench.images --encoding`` and ``--promise``; each target is ``NAME=URL``, so one run
compares servers that differ in one setting, rounds interleaved so the machine's drift falls on
each alike):

- **encoding**: ``--text-lanes`` streamed text replies (greedy, ``--tokens`` each, end of text
  ignored) run alone, then again while ``--images`` requests with new images (so each is
  encoded) arrive ``--delay`` s after them, ``--interval`` s apart. Reported per target: the text
  lanes' largest gap between two tokens (the longest any reader of them stared at a frozen
  stream), their p99 gap, their decode rate (tokens after the first over the time they took,
  summed over lanes), and the image requests' first-token times. Compare a server with
  ``--image-encoding tick`` against one with ``admission`` (the default).
- **promise**: ``--max-batch L`` servers. L background requests with new images and ``--tokens``
  each; an interactive chat (4 tokens) arrives once every media request that got a lane decodes
  (*decoding*), and in another run ``--delay`` s after the media requests were sent, while their
  images still encode (*encoding*). Reported: the chat's time to first token, and how many media
  lanes ran when it arrived. Compare ``--urgent-lanes 1`` (the default) with ``0``, and
  ``--image-encoding tick`` with ``admission``.
"""

from __future__ import annotations

import asyncio
import random
import time
from statistics import median

from .images import chat, decode_rate, image_content, stream
from .smoothness import gaps, percentile


def _colour(rng: random.Random) -> tuple[int, int, int]:
    return tuple(rng.randrange(256) for _ in range(3))


def _gap_figures(runs: list[dict]) -> dict:
    lanes = [gaps(r["times"]) for r in runs]
    pooled = [g for lane in lanes for g in lane]
    return {"max_gap_s": round(max(pooled), 3) if pooled else None,
            "p99_gap_s": round(percentile(pooled, 0.99), 3) if pooled else None,
            "decode_tok_s": round(decode_rate(runs), 1)}


async def _text_with_images(session, base: str, model: str, text: list[dict], n_images: int, delay: float,
                            interval: float, rng: random.Random):
    """(the text lanes' runs, the image requests' runs): the images arrive ``delay`` s after the
    text lanes are sent, ``interval`` s apart, each a new image."""
    async def image_at(t: float):
        await asyncio.sleep(t)
        return await stream(session, base, chat(model, 8, image_content(_colour(rng))))

    images = [asyncio.create_task(image_at(delay + i * interval)) for i in range(n_images)]
    runs = await asyncio.gather(*(stream(session, base, b) for b in text))
    return runs, await asyncio.gather(*images)


async def encoding(session, targets: dict[str, str], model: str, lanes: int, tokens: int, n_images: int,
                   delay: float, interval: float, rounds: int) -> dict:
    text = [chat(model, tokens, f"Write a long story about lighthouse number {i}.") for i in range(lanes)]
    for base in targets.values():  # warm: prompts cached alike in every run
        await asyncio.gather(*(stream(session, base, b) for b in text))
    rng = random.Random(11)
    got: dict[str, dict[str, list]] = {name: {"alone": [], "images": [], "ttft": []} for name in targets}
    for _ in range(rounds):
        for name, base in targets.items():
            got[name]["alone"].append(_gap_figures(await asyncio.gather(*(stream(session, base, b) for b in text))))
            runs, images = await _text_with_images(session, base, model, text, n_images, delay, interval, rng)
            got[name]["images"].append(_gap_figures(runs))
            got[name]["ttft"] += [i["first"] - i["sent"] for i in images]
    out = {"text_lanes": lanes, "tokens": tokens, "images": n_images, "delay_s": delay, "interval_s": interval,
           "rounds": rounds, "targets": {}}
    for name, g in got.items():
        row = {}
        for cond in ("alone", "images"):
            row[cond] = {key: _median(r[key] for r in g[cond]) for key in ("max_gap_s", "p99_gap_s", "decode_tok_s")}
            row[cond]["max_gap_s_worst"] = max(r["max_gap_s"] for r in g[cond])
        row["decode_ratio"] = round(row["images"]["decode_tok_s"] / row["alone"]["decode_tok_s"], 3)
        row["image_ttft_p50_s"] = _median(g["ttft"])
        row["image_ttft_max_s"] = round(max(g["ttft"]), 3)
        out["targets"][name] = row
    return out


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(median(values), 3) if values else None


async def _view(session, base: str, model: str) -> dict:
    async with session.get(base + "/slots") as resp:
        return (await resp.json())["models"][model]


async def _all_media_decoding(session, base: str, model: str, n: int, timeout: float = 300.0) -> int:
    """Wait until every media request has reached the server and each that got a lane decodes;
    how many decode."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = await _view(session, base, model)
        media = [s for s in view["slots"] if s.get("images")]
        decoding = [s for s in media if s.get("generated_tokens", 0) > 0]
        if decoding and len(decoding) == len(media) and len(media) + view["queued"] == n:
            return len(decoding)
        await asyncio.sleep(0.05)
    raise TimeoutError("the media requests never all decoded")


async def _idle(session, base: str, model: str) -> None:
    while True:
        view = await _view(session, base, model)
        if not view["queued"] and all(s["state"] == "free" for s in view["slots"]):
            return
        await asyncio.sleep(0.1)


async def promise(session, targets: dict[str, str], model: str, lanes: int, tokens: int, delay: float,
                  rounds: int) -> dict:
    rng = random.Random(13)
    got: dict[str, dict[str, list]] = {name: {"decoding": [], "encoding": [], "media_running": []}
                                       for name in targets}
    question = chat(model, 4, "Quick question: what is the capital of France?")
    for _ in range(rounds):
        for name, base in targets.items():
            for when in ("decoding", "encoding"):
                media = [asyncio.create_task(stream(session, base, chat(model, tokens, image_content(_colour(rng))),
                                                    {"x-superfluid-qos": "background"})) for _ in range(lanes)]
                try:
                    if when == "decoding":
                        got[name]["media_running"].append(await _all_media_decoding(session, base, model, lanes))
                    else:
                        await asyncio.sleep(delay)
                    run = await stream(session, base, question, {"x-superfluid-qos": "interactive"})
                    got[name][when].append(run["first"] - run["sent"])
                finally:
                    for task in media:  # the server cancels a lane whose client went away
                        task.cancel()
                    await asyncio.gather(*media, return_exceptions=True)
                    await _idle(session, base, model)
    out = {"lanes": lanes, "media_tokens": tokens, "delay_s": delay, "rounds": rounds, "targets": {}}
    for name, g in got.items():
        out["targets"][name] = {
            "chat_ttft_while_decoding_s": {"p50": _median(g["decoding"]), "max": round(max(g["decoding"]), 3)},
            "chat_ttft_while_encoding_s": {"p50": _median(g["encoding"]), "max": round(max(g["encoding"]), 3)},
            "media_lanes_running": sorted(set(g["media_running"]))}
    return out
