"""A GGUF's chat facts (template, BOS and EOS text) read from its metadata header alone.

``superfluid template`` needs three values; :class:`superfluid.plugins.gguf_file.GgufFile` reads
the header without ``gguf.GGUFReader``'s seconds of per-token parsing, and the two token texts
are the only strings of the vocabulary decoded. The tensors are never touched."""

from __future__ import annotations

from superfluid.plugins.gguf_file import GgufFile, Strings

TOKENS = "tokenizer.ggml.tokens"


def chat_facts(path: str) -> tuple[str | None, str, str]:
    """(chat template or None, BOS text, EOS text) of the GGUF at ``path`` ("" for a token it
    does not name). OSError if it cannot be opened; a ValueError
    (:class:`~superfluid.plugins.gguf_file.GgufError`) if it is not a GGUF."""
    fields = GgufFile(path).fields

    def token(key: str) -> str:
        index, tokens = fields.get(key), fields.get(TOKENS)
        if not isinstance(index, int) or not isinstance(tokens, Strings) or not 0 <= index < len(tokens):
            return ""
        return tokens[index]

    template = fields.get("tokenizer.chat_template")
    return template if isinstance(template, str) else None, token("tokenizer.ggml.bos_token_id"), \
        token("tokenizer.ggml.eos_token_id")
