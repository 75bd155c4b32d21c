"""The smallest complete superfluid engine: it "generates" by echoing the prompt back, token by
token, then ends the reply with an end-of-generation token.

Select it in the TOML file with ``engine = "echo"`` in a ``[[models]]`` table (``path`` is
required by the configuration; the echo engine reads no file). Tokens are the prompt's UTF-8
bytes, so the echo is exact, multi-byte characters included.

It is a real engine as far as the scheduler can tell: a KV per slot (the tokens it holds, cut
and cleared as plans say), ticks run by the shared :class:`~superfluid.core.tick_runner.TickRunner`
(prefill chunks within the step budget, decode grants, the stop flag between steps, first-token
and quiet-tick ends, finish by EOS or ``max_tokens``), step timings for the cost model and its
KV occupancy. It declares only what it does: no parking, no prefix cache, no grammars, no
logprobs, no embeddings; the shared runner's defaults stand in for the primitives those gate.
"""

from __future__ import annotations

import time

from superfluid.core.engine import Engine, EngineCapabilities, ModelInfo
from superfluid.core.hookspecs import hookimpl
from superfluid.core.stop_flag import StopFlag
from superfluid.core.tick import StepTiming
from superfluid.core.tick_runner import TickRunner, prefill_shares, takes_one

EOS = 256  # the token after the last byte: ends every echo, renders as nothing
STEP_TOKENS = 512  # prompt tokens one step takes, across lanes (the engine's micro-batch)
# Chat messages render as their contents, one per line, so a chat's reply is its messages echoed.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"


class EchoRunner(TickRunner):
    """A slot's KV is the list of tokens it holds; its "sampler" is where its prompt ends
    (``self.samplers[slot]``: known up front for a lane that resumes, else found at its first
    sample), so the next token is the prompt's token at the number generated so far."""

    def __init__(self, stop_flag, kv_capacity: int):
        super().__init__(stop_flag, kv_capacity)
        self.kv: dict[int, list[int]] = {}

    def clear_kv(self, slot):
        self.kv.pop(slot, None)

    def keep_prefix(self, slot, pos):
        kv = self.kv.setdefault(slot, [])
        del kv[pos:]
        return len(kv) == pos

    def cut(self, slot, pos):
        del self.kv.setdefault(slot, [])[pos:]

    def kv_used(self, touched):
        return sum(len(kv) for kv in self.kv.values())

    def new_sampler(self, lp):
        self.samplers[lp.slot] = lp.replay_from  # a resumed lane's prompt ends where its replay starts

    def accepts(self, slot):
        return False  # the echo needs no penalties or grammar to see the prompt

    def echo(self, slot: int) -> tuple[int, bool]:
        """The next token and whether it ends the generation."""
        kv = self.kv[slot]
        if self.samplers.get(slot) is None:
            self.samplers[slot] = len(kv)  # the first sample: the whole prompt is in the KV
        n_prompt = self.samplers[slot]
        generated = len(kv) - n_prompt
        return (kv[generated], False) if generated < n_prompt else (EOS, True)

    def advance(self, active, plan, result):
        """One step: one token for each lane that takes one (decoding, replaying), then prompt
        tokens in the plan's order up to the step budget; a lane whose feed ends samples."""
        t0 = time.perf_counter()
        step = [(w, 1) for w in active if takes_one(w)] + prefill_shares(active, plan, STEP_TOKENS)
        n_decode = sum(1 for w, _ in step if w.decoding)
        for w, n in step:
            self.kv.setdefault(w.slot, []).extend(w.feed[:n])
            del w.feed[:n]
            w.pos += n
            w.result.n_fed += n
            if not w.decoding:
                w.result.n_prefill += n
            if w.sample and not w.feed:
                w.sampled(*self.echo(w.slot))
        result.steps.append(StepTiming(prefill_tokens=sum(n for _, n in step) - n_decode,
                                       decode_tokens=n_decode, seconds=time.perf_counter() - t0))
        return True


class EchoEngine(Engine):
    """In-process: ticks run on the model's thread; the stop flag is read between steps."""

    def __init__(self, *, model, config):
        lanes, context = model["max-batch"], model["max-context"] or 4096
        self.capabilities = EngineCapabilities(max_lanes=lanes, context_length=context,
                                               prefill_step_tokens=STEP_TOKENS)
        self.info = ModelInfo(name=model.name, path=model.path, chat_template=CHAT_TEMPLATE,
                              n_vocab=EOS + 1, n_ctx_train=context)
        self.stop_flag = StopFlag()  # raised by the daemon, read by the runner between steps
        self.runner = EchoRunner(self.stop_flag, kv_capacity=lanes * context)

    def start(self, progress=None):
        if progress:
            progress("echo engine: nothing to load")

    def tokenize(self, text, *, add_special=True, parse_special=True):
        return list(text.encode("utf-8"))

    def token_bytes(self, token):
        return bytes([token]) if token < EOS else b""

    def run_tick(self, plan):
        return self.runner.run(plan)

    def request_stop(self):
        self.stop_flag.request_stop()

    def request_yield(self):
        self.stop_flag.request_yield()

    def clear_stop(self):
        self.stop_flag.clear()

    def close(self):
        self.runner.kv.clear()

    def describe(self):
        return {"engine": "echo", "state": "ready"}  # /health; the KV is on /slots


@hookimpl
def superfluid_add_engines(register):
    register("echo", EchoEngine)
