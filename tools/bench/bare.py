"""The bare runtime as a bench target: llama.cpp driven by the shortest loop that does
the method's work, with no server around it.

A serving layer can only add cost to the runtime it drives, so this loop is the
ceiling for any server on the same build. Measured in the same run as the servers, it
shows how much of the runtime's speed each of them keeps: a ratio to it near 1.0
means that server has nothing left to take.

The loop runs in a child process (``python -m tools.bench.bare``) so the model is
loaded once and the bench's event loop is never blocked. One line of JSON in, one
out: ``{"prompts": [...], "max_tokens": N}`` -> ``{"completion_tokens": [...],
"tokens": [[...], ...]}``. All prompts are prefilled in one ``llama_decode`` (split at
``n_batch``), then every lane decodes one token a step, picked by argmax, until each
has ``max_tokens`` (end of generation is ignored, as the method's ``ignore_eos``).
The context is laid out as superfluid's and llama-server's are: one KV buffer of
``--context`` cells per sequence, flash attention on llama.cpp's auto setting.
Greedy only.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path

SCHEME = "llamacpp:"
N_BATCH = 2048
N_UBATCH = 512


def is_bare(base: str) -> bool:
    """Whether a target's address names a model file for the bare loop."""
    return base.startswith(SCHEME)


def model_path(base: str) -> str:
    return base[len(SCHEME):]


class BareLoop:
    """One llama.cpp context and the loop over it (runs in the child process)."""

    def __init__(self, path: str, lanes: int, context: int, threads: int, extra_buffers: str = "auto"):
        import llama_cpp as L
        import numpy as np

        from superfluid.plugins.llamacpp.extra_buffers import choose, model_params

        self.L, self.np = L, np
        L.llama_backend_init()
        # the worker's decision (llama.cpp's AMX path crashes on batched decodes): a ceiling that
        # crashed, or took a path the server avoids, would measure nothing the server can reach
        self.model = L.llama_model_load_from_file(path.encode(), model_params(choose(extra_buffers).use))
        if not self.model:
            raise RuntimeError(f"cannot load {path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max, cp.kv_unified = lanes * context, lanes, False
        cp.n_batch, cp.n_ubatch = N_BATCH, N_UBATCH
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = -1
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"cannot create a context of {lanes} x {context} cells")
        self.lanes, self.context = lanes, context
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(N_BATCH, 0, lanes)

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (self.L.llama_token * (len(raw) + 8))()
        n = self.L.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), True, True)
        if n < 0:
            raise ValueError("prompt does not tokenize")
        return list(buf[:n])

    def _add(self, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        i = b.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
        b.seq_id[i][0] = seq
        b.n_tokens = i + 1

    def _decode(self) -> None:
        rc = self.L.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax_rows(self, n_rows: int):
        """The argmax of each output row of the last decode, in batch order."""
        ptr = self.L.llama_get_logits(self.ctx)
        rows = self.np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_rows, self.n_vocab))
        return rows.argmax(axis=1).tolist()

    def run(self, prompts: list[str], max_tokens: int) -> list[list[int]]:
        """Greedy replies of ``max_tokens`` tokens to every prompt, decoded together."""
        if not 1 <= len(prompts) <= self.lanes:
            raise ValueError(f"{len(prompts)} prompts for {self.lanes} lanes")
        seqs = [self.tokenize(p) for p in prompts]
        if any(len(s) + max_tokens > self.context for s in seqs):
            raise ValueError(f"a prompt plus {max_tokens} tokens exceeds {self.context} cells")
        self.L.llama_memory_clear(self.mem, True)
        last = self._prefill(seqs)
        out = [[t] for t in last]
        pos = [len(s) for s in seqs]
        for _ in range(max_tokens - 1):
            self.batch.n_tokens = 0
            for lane, reply in enumerate(out):
                self._add(reply[-1], pos[lane], lane, True)
                pos[lane] += 1
            self._decode()
            for lane, token in enumerate(self._argmax_rows(len(out))):
                out[lane].append(token)
        return out

    def _prefill(self, seqs: list[list[int]]) -> list[int]:
        """Every prompt, N_BATCH tokens a call; the first reply token of each lane."""
        firsts: dict[int, int] = {}
        pending: list[int] = []
        self.batch.n_tokens = 0
        for lane, seq in enumerate(seqs):
            for pos, token in enumerate(seq):
                is_last = pos == len(seq) - 1
                self._add(token, pos, lane, is_last)
                if is_last:
                    pending.append(lane)
                if self.batch.n_tokens == N_BATCH:
                    self._flush(pending, firsts)
        if self.batch.n_tokens:
            self._flush(pending, firsts)
        return [firsts[lane] for lane in range(len(seqs))]

    def _flush(self, pending: list[int], firsts: dict[int, int]) -> None:
        self._decode()
        for lane, token in zip(pending, self._argmax_rows(len(pending))):
            firsts[lane] = token
        pending.clear()
        self.batch.n_tokens = 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.bare",
                                description="The bare llama.cpp loop, driven by JSON lines on stdin.")
    p.add_argument("--model", required=True)
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--context", type=int, default=4096, help="KV cells per sequence (default 4096)")
    p.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 8))
    p.add_argument("--extra-buffers", choices=("auto", "on", "off"), default="auto",
                   help="llama.cpp's extra buffer types, decided as the server's --llama-extra-buffers")
    args = p.parse_args(argv)
    out = sys.stdout
    sys.stdout = sys.stderr  # llama.cpp and Python chatter must not reach the protocol
    try:
        loop = BareLoop(args.model, args.lanes, args.context, args.threads, args.extra_buffers)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which stops
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ready": Path(args.model).name}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            replies = loop.run(list(req["prompts"]), int(req["max_tokens"]))
            msg = {"completion_tokens": [len(r) for r in replies], "tokens": replies}
        except Exception as e:  # noqa: BLE001 - one bad request is reported, the loop goes on
            msg = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(msg) + "\n")
        out.flush()
    return 0


class BareError(RuntimeError):
    """The bare loop could not start or could not run a round."""


class BareTarget:
    """The parent's handle on one child process running the bare loop."""

    def __init__(self, path: str, lanes: int, context: int = 4096, threads: int | None = None,
                 extra_buffers: str = "auto"):
        self.path, self.lanes, self.context = path, lanes, context
        self.threads = threads
        self.extra_buffers = extra_buffers
        self.proc: asyncio.subprocess.Process | None = None
        self._log = tempfile.TemporaryFile()

    @property
    def model(self) -> str:
        return Path(self.path).name

    async def start(self, timeout: float = 120.0) -> None:
        cmd = [sys.executable, "-m", "tools.bench.bare", "--model", self.path,
               "--lanes", str(self.lanes), "--context", str(self.context), "--extra-buffers", self.extra_buffers]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        root = Path(__file__).resolve().parents[2]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(root)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]))
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=self._log, env=env)
        msg = await self._read(timeout)
        if "ready" not in msg:
            raise BareError(f"bare loop on {self.path} did not start: {msg.get('error', msg)}")

    async def run(self, prompts: list[str], max_tokens: int, timeout: float) -> dict:
        assert self.proc and self.proc.stdin
        self.proc.stdin.write((json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n").encode())
        await self.proc.stdin.drain()
        msg = await self._read(timeout)
        if "error" in msg:
            raise BareError(f"bare loop: {msg['error']}")
        return msg

    async def _read(self, timeout: float) -> dict:
        assert self.proc and self.proc.stdout
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            await self.proc.wait()
            raise BareError(f"bare loop exited with {self.proc.returncode}: {self._tail()}")
        return json.loads(line)

    def _tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-1500:].decode(errors="replace").strip()

    async def close(self) -> None:
        if self.proc and self.proc.returncode is None:
            assert self.proc.stdin
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self._log.close()


if __name__ == "__main__":
    sys.exit(main())
