"""What images cost a server that also serves text, and what its media rules give, measured
against a running server that serves a vision model:

    python -m tools.fixtures.tiny_vlm --hybrid        # SmolLM2-135M with a tiny vision half
    superfluid serve --model ~/.cache/superfluid/models/smolvlm-hybrid-v1/model.gguf --max-batch 4
    python -m tools.bench.images --target http://127.0.0.1:8080

- **neighbours**: ``--text-lanes`` streamed text replies (greedy, ``--tokens`` each, end of text
  ignored) run alone, then again while image requests (a new image each, so each is encoded)
  arrive every ``--interval`` seconds on another lane, then while the same requests without their
  image arrive (what any arrival costs); the three runs repeat ``--rounds`` times, interleaved.
  Reported: the text lanes' decode rate (tokens after the first over the time they took, summed
  over lanes), each condition's median and its median ratio to the alone run of its round, and
  the arrivals' first-token times.
- **reuse**: one image and prompt sent twice: the encoder runs (``superfluid_images_encoded_total``)
  and the prompt tokens prefilled (``usage``: prompt minus cached) each time.
- **preemption** (``--preemption``, against a ``--max-batch 1`` server): a background request with
  an image decodes while an interactive chat arrives, then the same without the image. Reported:
  preemptions (``superfluid_preemptions_total``) during each and the background reply's tokens.
- **encoding** (``--encoding``) and **promise** (``--promise``), against several servers at once
  (``--target NAME=URL``, repeated) of a tower of a real size (``python -m
  tools.fixtures.vlm_big_tower``): the text lanes' gaps and decode rate while images encode on the
  tick or off it, and a chat's first token while media lanes hold the lanes
  (:mod:`tools.bench.image_lanes`).

Run it on a quiet machine: the decode rates are the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import sys
import time
from statistics import median

import aiohttp

from . import machine
from .client import first_model

QUESTION = "What is in this picture?"


def png(rgb: tuple[int, int, int], size: int = 64) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(model: str, tokens: int, content, stream: bool = True) -> dict:
    return {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
            "messages": [{"role": "user", "content": content}]}


def image_content(rgb, text: str = QUESTION) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": png(rgb)}}, {"type": "text", "text": text}]


async def stream(session: aiohttp.ClientSession, base: str, body: dict, headers: dict | None = None) -> dict:
    """A streamed reply's timings: when it was sent, its first token, its end, and its tokens."""
    t0 = time.perf_counter()
    first, tokens, usage, times = None, 0, None, []
    async with session.post(base + "/v1/chat/completions", json=body, headers=headers or {}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.read())[:300]!r}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                tokens += 1
                times.append(time.perf_counter())
                first = first or times[-1]
    return {"sent": t0, "first": first, "end": time.perf_counter(), "usage": usage, "times": times}


def decode_rate(runs: list[dict]) -> float:
    """Text lanes' decode tokens per second, summed: each lane's tokens after its first over the
    time they took."""
    return sum((r["usage"]["completion_tokens"] - 1) / max(r["end"] - r["first"], 1e-9) for r in runs)


async def neighbours(session, base: str, model: str, lanes: int, tokens: int, interval: float,
                     rounds: int) -> dict:
    text = [chat(model, tokens, f"Write a long story about lighthouse number {i}.") for i in range(lanes)]
    await asyncio.gather(*(stream(session, base, b) for b in text))  # warm: prompts cached alike in every run
    rng = random.Random(7)

    def an_image():
        return image_content(tuple(rng.randrange(256) for _ in range(3)))

    def a_text():  # the same request without its image: what any arrival costs
        return f"{rng.randrange(10 ** 6)} {QUESTION}"

    # the three conditions interleaved, round after round, so the machine's drift falls on each alike
    rates: dict[str, list[float]] = {"alone": [], "images": [], "text_arrivals": []}
    ratios: dict[str, list[float]] = {"images": [], "text_arrivals": []}
    ttfts: dict[str, list[float]] = {"images": [], "text_arrivals": []}
    for _ in range(rounds):
        alone = decode_rate(await asyncio.gather(*(stream(session, base, b) for b in text)))
        rates["alone"].append(alone)
        for name, content in (("images", an_image), ("text_arrivals", a_text)):
            beside, arrived = await _with_arrivals(session, base, model, text, content, interval)
            rates[name].append(decode_rate(beside))
            ratios[name].append(decode_rate(beside) / alone)
            ttfts[name] += [r["first"] - r["sent"] for r in arrived]
    out = {"text_lanes": lanes, "tokens": tokens, "interval_s": interval, "rounds": rounds,
           "decode_tok_s_alone_median": round(median(rates["alone"]), 1)}
    for name in ("images", "text_arrivals"):
        out[name] = {"decode_tok_s_median": round(median(rates[name]), 1),
                     "ratio_median": round(median(ratios[name]), 3), "arrivals": len(ttfts[name]),
                     "ttft_p50_s": round(median(ttfts[name]), 3) if ttfts[name] else None}
    return out


async def _with_arrivals(session, base: str, model: str, text: list[dict], content, interval: float):
    """The text lanes' runs while a request of ``content()`` arrives every ``interval`` s (one at a
    time), and those requests' runs."""
    arrived: list[dict] = []
    done = asyncio.Event()

    async def arrive():
        while not done.is_set():
            arrived.append(await stream(session, base, chat(model, 8, content())))
            try:
                await asyncio.wait_for(done.wait(), interval)
            except asyncio.TimeoutError:
                pass

    arrivals = asyncio.create_task(arrive())
    beside = await asyncio.gather(*(stream(session, base, b) for b in text))
    done.set()
    await arrivals
    return beside, arrived


async def metric(session, base: str, name: str) -> float:
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


async def reuse(session, base: str, model: str) -> dict:
    content = image_content((12, 200, 90), "Describe this image in one sentence.")
    out = []
    for _ in range(2):
        before = await metric(session, base, "superfluid_images_encoded_total")
        run = await stream(session, base, chat(model, 4, content))
        await asyncio.sleep(0.3)
        usage = run["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out.append({"encoder_runs": await metric(session, base, "superfluid_images_encoded_total") - before,
                    "prompt_tokens": usage["prompt_tokens"], "prefilled": usage["prompt_tokens"] - cached,
                    "ttft_s": round(run["first"] - run["sent"], 3)})
    return {"first": out[0], "second": out[1]}


async def preemption(session, base: str, model: str, tokens: int) -> dict:
    out = {}
    for name, content in (("image", image_content((250, 250, 0))), ("text", QUESTION)):
        before = await metric(session, base, "superfluid_preemptions_total")
        background = asyncio.create_task(stream(session, base, chat(model, tokens, content),
                                                {"x-superfluid-qos": "background"}))
        while not (await _decoding(session, base)):
            await asyncio.sleep(0.02)
        asked = time.perf_counter()
        chat_run = await stream(session, base, chat(model, 4, "Quick question."), {"x-superfluid-qos": "interactive"})
        lane = await background
        await asyncio.sleep(0.3)
        out[name] = {"preemptions": await metric(session, base, "superfluid_preemptions_total") - before,
                     "background_tokens": lane["usage"]["completion_tokens"],
                     "chat_ttft_s": round(chat_run["first"] - asked, 3)}
    return out


async def _decoding(session, base: str) -> bool:
    async with session.get(base + "/slots") as resp:
        models = (await resp.json())["models"]
    return any(s.get("generated_tokens", 0) > 0 for m in models.values() for s in m["slots"])


def targets(given: list[str] | None) -> dict[str, str]:
    """``--target`` values as {name: URL}: ``NAME=URL``, or a bare URL named by itself."""
    out = {}
    for value in given or ["http://127.0.0.1:8080"]:
        name, sep, url = value.partition("=")
        out[name if sep else value] = url if sep else value
    return out


async def main_async(args) -> dict:
    from . import image_lanes

    named = targets(args.target)
    first = next(iter(named.values()))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        model = args.model or await first_model(session, first, 60)
        report = {"machine": machine.describe(), "target": named, "model": model}
        if args.encoding:
            report["encoding"] = await image_lanes.encoding(session, named, model, args.text_lanes, args.tokens,
                                                            args.images, args.delay, args.interval, args.rounds)
        elif args.promise:
            report["promise"] = await image_lanes.promise(session, named, model, args.media_lanes, args.tokens,
                                                          args.delay, args.rounds)
        elif args.preemption:
            report["preemption"] = await preemption(session, first, model, args.tokens)
        else:
            report["reuse"] = await reuse(session, first, model)
            report["neighbours"] = await neighbours(session, first, model, args.text_lanes, args.tokens,
                                                    args.interval, args.rounds)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", help="a server's URL, or NAME=URL (repeatable with --encoding "
                    "and --promise, which compare the servers; default http://127.0.0.1:8080)")
    ap.add_argument("--model")
    ap.add_argument("--text-lanes", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between image requests")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the three neighbour runs, interleaved")
    ap.add_argument("--preemption", action="store_true", help="the preemption check (a --max-batch 1 server)")
    ap.add_argument("--encoding", action="store_true", help="text lanes' gaps and decode rate while images "
                    "encode (compare --image-encoding tick and admission servers; tools/bench/image_lanes.py)")
    ap.add_argument("--promise", action="store_true", help="a chat's first token while media lanes hold the "
                    "lanes (compare --urgent-lanes 1 and 0 servers; tools/bench/image_lanes.py)")
    ap.add_argument("--images", type=int, default=2, help="--encoding: image requests per run")
    ap.add_argument("--delay", type=float, default=1.0, help="--encoding: seconds before the first image; "
                    "--promise: seconds after the media requests before the chat, while they encode")
    ap.add_argument("--media-lanes", type=int, default=4, help="--promise: media requests sent (the servers' --max-batch)")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
