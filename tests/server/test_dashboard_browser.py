"""GET /dashboard in a real browser: headless Chromium (Debian's package, driven by playwright)
watches a real server on the default model while a small QoS workload runs.

Two agents fill both lanes, two background requests queue behind them, and an interactive chat
preempts an agent. The page must show the lanes going free -> busy -> free, the preemption (the
count, and the mark on the lane the chat took), and the same queue counts as /slots. A second
test opens the page with ?key= under a key policy and reads the per-key table. A screenshot is saved as a test artifact (SUPERFLUID_ARTIFACTS,
default test-artifacts/ under the repo root), because a human should be able to look at what the
test saw.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from superfluid.plugins.http.keys.policy import hash_secret

CHROMIUM = "/usr/bin/chromium"
# The machine's network is closed: these stop Chromium's own background connections.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
INTERVAL_MS = 200

# tools/dev/setup.sh installs Debian's chromium (CI included), so a missing browser is a failure,
# not a silent skip; SUPERFLUID_SKIP_BROWSER=1 skips these tests on a machine without one.
pytestmark = pytest.mark.skipif(bool(os.environ.get("SUPERFLUID_SKIP_BROWSER")),
                                reason="SUPERFLUID_SKIP_BROWSER is set")


def prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


class Completion:
    """One /v1/completions call in a worker thread that the test can hang up on, so the workload
    ends when the test has seen what it needs, however slowly the shared machine decodes."""

    def __init__(self, pool, srv, text: str, max_tokens: int, qos: str):
        self.conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
        self.conn.connect()
        body = json.dumps({"prompt": prompt(text), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        self.future = pool.submit(self._call, body, qos)

    def _call(self, body: str, qos: str) -> int:
        self.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                             "x-superfluid-qos": qos})
        response = self.conn.getresponse()
        response.read()
        return response.status

    def hang_up(self) -> None:
        if not self.future.done():
            try:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conn.close()


def artifact_dir() -> Path:
    path = Path(os.environ.get("SUPERFLUID_ARTIFACTS") or REPO / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def wait_until(pred, timeout: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# Records every data-state a lane row takes (a MutationObserver sees each redraw, so a state
# shown for one snapshot only is not missed between two polls), and the preemption marks.
RECORDER = """() => {
  window.__seen = {states: {}, preemptedMark: false, tookFrom: []};
  const note = (row) => {
    const lane = row.dataset.lane, state = row.dataset.state;
    const seq = (window.__seen.states[lane] = window.__seen.states[lane] || []);
    if (seq[seq.length - 1] !== state) seq.push(state);
    if (state === "preempted" || Number(row.dataset.preemptions) > 0) window.__seen.preemptedMark = true;
    if (row.dataset.tookFrom) window.__seen.tookFrom.push([lane, row.dataset.qos, row.dataset.tookFrom]);
  };
  document.querySelectorAll("[data-lane]").forEach(note);
  new MutationObserver((records) => {
    for (const r of records) {
      const row = r.target.closest && r.target.closest("[data-lane]");
      if (row) note(row);
    }
  }).observe(document.body, {subtree: true, attributes: true, childList: true,
                              attributeFilter: ["data-state", "data-preemptions", "data-took-from"]});
}"""


def page_lanes(page) -> list[str]:
    """The page's busy lanes' states, slot order ("free": all four slots, two lanes' KV buffers and
    two spare ones, are free)."""
    states = page.eval_on_selector_all(f'[data-model="{MODEL}"] [data-lane]', "els => els.map(e => e.dataset.state)")
    busy = [s for s in states if s != "free"]
    return busy if busy or len(states) != 4 else ["free"]


def page_queues(page) -> dict[str, int]:
    return page.eval_on_selector_all(f'[data-model="{MODEL}"] [data-queue]',
                                     "els => Object.fromEntries(els.map(e => [e.dataset.queue, Number(e.dataset.count)]))")


def slots_queues(srv) -> dict[str, int]:
    counts = collections.Counter(q["qos"] for q in srv.get_json("/slots")["models"][MODEL]["queue"])
    return dict(counts)


def queues_match(srv, page) -> dict[str, int] | None:
    """The page's non-zero queue counts when they equal /slots' read just before and just after
    (the page lags the server by up to one snapshot interval, so a moving queue is sampled again)."""
    before = slots_queues(srv)
    shown = {name: n for name, n in page_queues(page).items() if n}
    after = slots_queues(srv)
    return shown if shown == before == after else None


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), (f"{CHROMIUM} is not installed: tools/dev/setup.sh installs Debian's "
                                      "chromium (or set SUPERFLUID_SKIP_BROWSER=1)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def open_dashboard(browser, url: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.goto(url)
    page.wait_for_selector('#connection[data-state="open"]', timeout=15_000)
    return page, errors


def test_dashboard_follows_a_qos_workload(start_server, browser):
    srv = start_server("--max-batch", "2")
    page, errors = open_dashboard(browser, f"{srv.base}/dashboard?interval_ms={INTERVAL_MS}")
    wait_until(lambda: page_lanes(page) == ["free"], 15, "four free slots on the page")
    assert set(page_queues(page)) >= {"interactive", "agent", "background"}
    page.evaluate(RECORDER)
    shot = artifact_dir() / "dashboard.png"

    def lanes():  # the two lanes that run (of four slots)
        return [s for s in srv.get_json("/slots")["models"][MODEL]["slots"] if s["state"] != "free"]

    with cf.ThreadPoolExecutor(5) as pool:
        agents = [Completion(pool, srv, f"Write a long story about lighthouse number {i}.", 200, "agent")
                  for i in range(2)]
        wait_until(lambda: len(lanes()) == 2, 60, "both lanes busy with agents", every=0.1)
        background = [Completion(pool, srv, f"Count slowly to {i + 20}.", 200, "background") for i in range(2)]
        wait_until(lambda: slots_queues(srv).get("background") == 2, 30, "two queued background requests")
        # The page shows what /slots shows: both background requests waiting.
        matched = wait_until(lambda: queues_match(srv, page), 10, "the page's queues to match /slots")
        assert matched == {"background": 2}
        wait_until(lambda: len(lanes()) == 2 and all(s["state"] == "decoding" and s["generated_tokens"] >= 2
                                                     for s in lanes()),
                   60, "both agents decoding", every=0.1)
        wait_until(lambda: page_lanes(page) == ["decoding", "decoding"], 10, "the page showing both agents decoding")
        chat = Completion(pool, srv, "Hi!", 24, "interactive")
        # The chat takes an agent's lane: the page's counter (or the lane's mark) shows it.
        wait_until(lambda: int(page.get_attribute("#preemptions", "data-count")) >= 1
                   or page.evaluate("window.__seen.preemptedMark"), 30, "a preemption on the page")
        # The preempted agent waits in its class's queue, in front of the background requests.
        matched = wait_until(lambda: queues_match(srv, page), 10, "the page's queues to match /slots again")
        assert matched.get("background") == 2, matched
        page.screenshot(path=str(shot), full_page=True)
        print(f"dashboard screenshot: {shot}")
        assert chat.future.result(timeout=60) == 200
        for call in agents + background:  # enough seen: hang up, and the lanes go free
            call.hang_up()
        cf.wait([c.future for c in agents + background], timeout=30)

    wait_until(lambda: page_lanes(page) == ["free"], 30, "every slot free again on the page")
    preemptions = sum(v for k, v in srv.metrics().items() if k.split("{")[0] == "superfluid_preemptions_total")
    assert preemptions >= 1
    wait_until(lambda: int(page.get_attribute("#preemptions", "data-count")) == preemptions, 5,
               f"the page's preemption counter to read {preemptions}, as /metrics does")
    # the slots lanes ran in (two at a time, in any of the four over the run)
    seen = {lane: states for lane, states in page.evaluate("window.__seen.states").items() if len(states) > 1}
    for lane, states in seen.items():  # free -> prefilling/decoding -> free, as the page drew it
        assert states[0] == "free" and states[-1] == "free", f"lane {lane}: {states}"
        assert {"prefilling", "decoding"} & set(states), f"lane {lane}: {states}"
    assert 2 <= len(seen) <= 4
    # The lane the chat took is marked with the class it took it from.
    assert ["interactive", "agent"] in [took[1:] for took in page.evaluate("window.__seen.tookFrom")]
    # The tick timeline drew the work, TTFT has the interactive class, the stream was never cut.
    assert int(page.get_attribute(f'[data-model="{MODEL}"] svg.chart', "data-ticks")) > 0
    assert int(page.get_attribute(f'[data-model="{MODEL}"] [data-ttft="interactive"]', "data-count")) >= 1
    assert page.get_attribute("#connection", "data-state") == "open"
    assert not errors, errors
    assert shot.stat().st_size > 10_000
    page.close()


def test_dashboard_with_a_key_policy_shows_keys(start_server, browser, tmp_path):
    """EventSource sends no headers: the page passes its own ?key= on to /events, and with a key
    policy it lists each key's requests, tokens and rejections."""
    secrets = {"watcher": "sk-watch-secret", "app": "sk-app-secret"}
    policy = tmp_path / "keys.toml"
    policy.write_text(f'[keys.watcher]\nsha256 = "{hash_secret(secrets["watcher"])}"\nadmin = true\n\n'
                      f'[keys.app]\nsha256 = "{hash_secret(secrets["app"])}"\nrequests-per-minute = 1\n')
    srv = start_server("--key-policy", str(policy), "--max-batch", "2")
    page, errors = open_dashboard(browser, f"{srv.base}/dashboard?key={secrets['watcher']}&interval_ms={INTERVAL_MS}")

    def ask(max_tokens):
        req = urllib.request.Request(srv.base + "/v1/completions", method="POST",
                                     data=f'{{"prompt": "Hi", "max_tokens": {max_tokens}}}'.encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {secrets['app']}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert ask(4) == 200
    assert ask(4) == 429  # its one request a minute is spent: a rejection
    row = '#keys [data-key="app"]'

    def shown():
        return page.query_selector(row) and {f: int(page.get_attribute(row, "data-" + f))
                                             for f in ("requests", "tokens", "rejections")}
    wait_until(lambda: shown() and shown()["rejections"] == 1 and shown()["tokens"] > 0, 15,
               "the app key's request, tokens and rejection on the page")
    assert shown()["requests"] == 1
    assert page.is_visible("#keys-panel")
    assert page.query_selector('#keys [data-key="watcher"]')  # every key of the policy is listed
    # A key without the dashboard grant (or none) does not get the page.
    for query, status in ((f"?key={secrets['app']}", 403), ("", 401)):
        try:
            urllib.request.urlopen(f"{srv.base}/dashboard{query}", timeout=10)
            raise AssertionError(f"/dashboard{query} was served")
        except urllib.error.HTTPError as exc:
            assert exc.code == status
    assert not errors, errors
    page.close()
