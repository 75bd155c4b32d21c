"""Constrained-decoding libraries, measured on one model's vocabulary.

For one JSON Schema (an object: a name string, an age integer, a tags array of strings and a
nested address object) each library's matcher walks a fixed valid JSON text token by token. At
every token it computes the allowed-token mask and applies it to a logits row of the whole
vocabulary (disallowed tokens become -inf); then it accepts the token. Timed per token:
mask + apply (the headline numbers; the apply step also on its own) and accept, separately.
Also timed: the vocabulary's setup (once per model), compile (once per schema: the grammar
built, plus the first matcher) and start (each later matcher on the compiled schema: once per
request). Each library walks the text ``--reps`` times; the end of generation must be allowed
once the text is complete.

- llguidance: ``LLTokenizer`` from llama.cpp's vocab (``llguidance.llamacpp``), ``LLMatcher``,
  ``llguidance.numpy`` bitmask;
- xgrammar: ``TokenizerInfo`` from the vocab's token bytes, ``GrammarCompiler.compile_json_schema``,
  ``GrammarMatcher.fill_next_token_bitmask``;
- outlines-core: ``Index`` over a ``Vocabulary`` of the token bytes (a regex from the schema),
  ``Guide.write_mask_into``;
- llama.cpp's GBNF sampler (``llama_sampler_init_grammar``, the schema converted by
  ``llama_cpp.llama_grammar``'s JSON-Schema-to-GBNF converter) applied with ``llama_sampler_apply``
  to a candidate array of the whole vocabulary, then ``llama_sampler_accept``.

The three bitmask libraries share one apply step (the bitmask unpacked with numpy, the
disallowed logits set to -inf: what ``core/constrain.py`` does). Every library is held to the
same layout, ``", "`` and ``": "`` between items and no other whitespace, so the same tokens
are valid for all of them; a token a library refuses is reported as an error.

    .venv/bin/python tools/bench/constraint_libs.py [--model PATH] [--reps 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import sys
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
VALUE = {"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "poetry", "analytical engine"],
         "address": {"city": "London", "zip": "W1J 7NT"}}
TEXT = json.dumps(VALUE)  # ", " and ": " between items
SEPARATORS = (", ", ": ")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


class LlamaVocab:
    """A vocab-only llama.cpp load of the model (as plugins/vocab/gguf.py does)."""

    def __init__(self, path: str):
        import llama_cpp
        import llama_cpp._logger

        llama_cpp._logger.logger.setLevel(logging.ERROR)
        from superfluid.plugins.llamacpp.extra_buffers import choose, model_params

        llama_cpp.llama_backend_init()
        params = model_params(choose("auto").use)  # the worker's decision, though only the vocabulary loads
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise SystemExit(f"cannot read {path} as a GGUF model")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.eos = llama_cpp.llama_vocab_eos(self.vocab)
        self._llama = llama_cpp

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        buf = (self._llama.llama_token * (len(data) + 8))()
        n = self._llama.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, False)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self._llama.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._llama.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def token_bytes(self) -> list[bytes]:
        """Each token's text (control tokens: empty)."""
        return [self.piece(t) for t in range(self.n_vocab)]


class NotInstalled(Exception):
    pass


def _apply_bitmask(bits: np.ndarray, logits: np.ndarray, n_vocab: int) -> float:
    """Disallowed tokens' logits to -inf, in place (core/constrain.py's LaneConstraint.mask);
    returns the seconds it took (part of the mask + apply time)."""
    t = time.perf_counter()
    allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:n_vocab].astype(bool)
    logits[:n_vocab][~allowed] = -np.inf
    return time.perf_counter() - t


class Llguidance:
    name, dist = "llguidance", "llguidance"

    def setup(self, v: LlamaVocab) -> float:
        try:
            import llguidance
            import llguidance.llamacpp
            import llguidance.numpy as lln
        except ImportError as exc:
            raise NotInstalled(str(exc)) from None
        self.ll, self.lln, self.n = llguidance, lln, v.n_vocab
        t = time.perf_counter()
        self.tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(v.vocab)
        return time.perf_counter() - t

    def compile(self) -> None:
        layout = {"whitespace_flexible": False, "item_separator": SEPARATORS[0],
                  "key_separator": SEPARATORS[1]}
        self.grammar = self.ll.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=layout)

    def start(self):
        m = self.ll.LLMatcher(self.tokenizer, self.grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        self.bits = self.lln.allocate_token_bitmask(1, self.n)
        return m

    def mask(self, m, logits: np.ndarray) -> None:
        self.lln.fill_next_token_bitmask(m, self.bits)
        self.last_apply_s = _apply_bitmask(self.bits, logits, self.n)

    def accept(self, m, token: int) -> None:
        if not m.consume_token(token):
            raise RuntimeError(f"refused token {token}: {m.get_error()}")


class Xgrammar:
    name, dist = "xgrammar", "xgrammar"

    def setup(self, v: LlamaVocab) -> float:
        try:
            import xgrammar
        except ImportError as exc:
            raise NotInstalled(str(exc)) from None
        self.xg, self.n = xgrammar, v.n_vocab
        t = time.perf_counter()
        info = xgrammar.TokenizerInfo(v.token_bytes(), xgrammar.VocabType.RAW, vocab_size=v.n_vocab,
                                      stop_token_ids=[v.eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        return time.perf_counter() - t

    def compile(self) -> None:
        self.compiled = self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                          separators=SEPARATORS)

    def start(self):
        self.bits_t = self.xg.allocate_token_bitmask(1, self.n)  # a torch tensor
        self.bits = self.bits_t.numpy()  # the same memory
        return self.xg.GrammarMatcher(self.compiled)

    def mask(self, m, logits: np.ndarray) -> None:
        m.fill_next_token_bitmask(self.bits_t)
        self.last_apply_s = _apply_bitmask(self.bits, logits, self.n)

    def accept(self, m, token: int) -> None:
        if not m.accept_token(token):
            raise RuntimeError(f"refused token {token}")


class OutlinesCore:
    name, dist = "outlines-core", "outlines_core"

    def setup(self, v: LlamaVocab) -> float:
        try:
            import outlines_core
        except ImportError as exc:
            raise NotInstalled(str(exc)) from None
        self.oc, self.n = outlines_core, v.n_vocab
        t = time.perf_counter()
        table: dict[bytes, list[int]] = {}
        for token, text in enumerate(v.token_bytes()):
            if text and token != v.eos:
                table.setdefault(text, []).append(token)
        self.vocabulary = outlines_core.Vocabulary(v.eos, table)
        return time.perf_counter() - t

    def compile(self) -> None:
        # whitespace: at most one space, where JSON allows it (", " and ": " are what TEXT has)
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?")
        self.index = self.oc.Index(regex, self.vocabulary)

    def start(self):
        self.bits = np.zeros((1, (self.n + 31) // 32), dtype=np.int32)
        return self.oc.Guide(self.index)

    def mask(self, g, logits: np.ndarray) -> None:
        g.write_mask_into(self.bits.ctypes.data, self.bits.size, self.bits.itemsize)
        self.last_apply_s = _apply_bitmask(self.bits, logits, self.n)

    def accept(self, g, token: int) -> None:
        g.advance(token, return_tokens=False)


class LlamaGbnf:
    name, dist = "llama.cpp GBNF", "llama_cpp_python"

    def setup(self, v: LlamaVocab) -> float:
        import llama_cpp

        self.llama, self.v, self.n = llama_cpp, v, v.n_vocab
        self.cand = (llama_cpp.llama_token_data * v.n_vocab)()
        self.cand_np = np.frombuffer(self.cand, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
        self.array = llama_cpp.llama_token_data_array(data=self.cand, size=v.n_vocab, selected=-1, sorted=False)
        self.ids = np.arange(v.n_vocab, dtype=np.int32)
        self.samplers = []
        return 0.0

    def compile(self) -> None:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        self.gbnf = json_schema_to_gbnf(json.dumps(SCHEMA)).encode()

    def start(self):
        smpl = self.llama.llama_sampler_init_grammar(self.v.vocab, self.gbnf, b"root")
        if not smpl:
            raise RuntimeError("llama.cpp rejected the grammar")
        return smpl

    def load(self, logits: np.ndarray) -> None:
        """The candidate array from a logits row (llama_sampler_sample does this whatever the
        chain holds, so it is not timed)."""
        self.cand_np["id"] = self.ids
        self.cand_np["logit"] = logits[:self.n]
        self.cand_np["p"] = 0.0
        self.array.size, self.array.selected, self.array.sorted = self.n, -1, False

    def mask(self, smpl, logits: np.ndarray) -> None:
        self.llama.llama_sampler_apply(smpl, ctypes.byref(self.array))
        self.last_apply_s = 0.0  # one call: the mask and its application are not separable

    def masked(self) -> np.ndarray:
        return np.array(self.cand_np["logit"])

    def accept(self, smpl, token: int) -> None:
        self.llama.llama_sampler_accept(smpl, token)

    def free(self, smpl) -> None:
        self.llama.llama_sampler_free(smpl)


LIBRARIES = (Llguidance, Xgrammar, OutlinesCore, LlamaGbnf)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure(lib, v: LlamaVocab, tokens: list[int], reps: int) -> dict:
    out = {"library": lib.name, "version": _version(lib.dist)}
    try:
        out["vocab_setup_s"] = lib.setup(v)
    except NotInstalled as exc:
        return {**out, "status": "not installed", "detail": exc.args[0]}
    rng = np.random.default_rng(0)
    base = rng.standard_normal(v.n_vocab).astype(np.float32)
    gbnf = isinstance(lib, LlamaGbnf)
    try:
        # compile: the once-per-schema work plus the first (cold) matcher; start: each later one
        t = time.perf_counter()
        lib.compile()
        first = lib.start()
        out["compile_ms"] = (time.perf_counter() - t) * 1e3
        if gbnf:
            lib.free(first)
        mask_ms, apply_ms, accept_ms, start_ms = [], [], [], []
        for _ in range(reps):
            t = time.perf_counter()
            state = lib.start()
            start_ms.append((time.perf_counter() - t) * 1e3)
            for i, token in enumerate(tokens + [v.eos]):
                logits = base.copy()
                if gbnf:
                    lib.load(logits)
                t = time.perf_counter()
                lib.mask(state, logits)
                dt = (time.perf_counter() - t) * 1e3
                row = lib.masked() if gbnf else logits
                if not np.isfinite(row[token]):
                    what = "end of generation" if i == len(tokens) else f"token {token} {v.piece(token)!r}"
                    raise RuntimeError(f"mask refused {what} at position {i}")
                if i == len(tokens):  # the grammar is complete: the mask allows the end
                    break
                mask_ms.append(dt)
                apply_ms.append(lib.last_apply_s * 1e3)
                t = time.perf_counter()
                lib.accept(state, token)
                accept_ms.append((time.perf_counter() - t) * 1e3)
            if gbnf:
                lib.free(state)
    except Exception as exc:  # noqa: BLE001 - a library's failure is a result, not a crash
        return {**out, "status": "error", "detail": f"{type(exc).__name__}: {exc}"}
    return {**out, "status": "ok", "tokens": len(tokens), "reps": reps,
            "start_ms": statistics.fmean(start_ms),
            "mean_ms": statistics.fmean(mask_ms), "p50_ms": _pct(mask_ms, 0.5), "p99_ms": _pct(mask_ms, 0.99),
            "apply_ms": statistics.fmean(apply_ms), "accept_ms": statistics.fmean(accept_ms)}


def table(results: list[dict]) -> str:
    head = ("| library | version | vocab setup s | compile ms | start ms | tokens | mask+apply mean ms "
            "| p50 ms | p99 ms | of which apply ms | accept mean ms |")
    lines = [head, "|" + "---|" * 11]
    for r in results:
        if r["status"] != "ok":
            detail = "not installed" if r["status"] == "not installed" else r["detail"]
            lines.append(f"| {r['library']} | {r['version']} | {detail} |" + " |" * 8)
            continue
        lines.append(f"| {r['library']} | {r['version']} | {r['vocab_setup_s']:.2f} | {r['compile_ms']:.1f} "
                     f"| {r['start_ms']:.2f} | {r['tokens']} | {r['mean_ms']:.3f} | {r['p50_ms']:.3f} "
                     f"| {r['p99_ms']:.3f} | {r['apply_ms']:.3f} | {r['accept_ms']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF model (default: superfluid's default model)")
    ap.add_argument("--reps", type=int, default=50, help="walks of the text per library (default 50)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--only", action="append", metavar="LIB", help="run only these (by name; repeatable)")
    args = ap.parse_args(argv)
    path = args.model
    if path is None:
        from superfluid.core.default_model import default_model_path

        path = str(default_model_path())
    v = LlamaVocab(path)
    tokens = v.tokenize(TEXT)
    print(f"model {path}: {v.n_vocab} tokens; walk: {len(tokens)} tokens of {TEXT}", file=sys.stderr)
    results = []
    for cls in LIBRARIES:
        if args.only and cls.name not in args.only:
            continue
        r = measure(cls(), v, tokens, args.reps)
        print(f"{r['library']}: {r['status']}", file=sys.stderr)
        results.append(r)
    print(table(results))
    if args.json:
        doc = {"model": path, "n_vocab": v.n_vocab, "text": TEXT, "schema": SCHEMA,
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version()},
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
