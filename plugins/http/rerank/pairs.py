"""A (query, document) pair as a reranker's prompt tokens, as llama-server builds it.

A model with a rerank template (``RerankFormat.template``, Qwen3-Reranker's instruction with
``{query}`` and ``{document}`` in it) gets the template with the two texts in place; any other
gets ``prefix`` query ``middle`` document ``suffix`` (BOS query EOS SEP document EOS, as its
vocabulary adds them).

Unlike llama-server, the client's texts are tokenized as text: special-token markup inside a
query or document (``<|im_end|>``) stays characters, so a document cannot close the template's
turn and write its own verdict. Only the template's own pieces are parsed for special tokens. A
piece's trailing whitespace goes with the text that follows it (``"<Query>:" + " what"``), so a
byte-level BPE tokenizer splits the pair as it splits the whole prompt: the tokens are the ones
the model card's reference (the template filled in, tokenized whole) gives for plain text."""

from __future__ import annotations

import re

from superfluid.core.engine import RerankFormat
from superfluid.core.errors import ContextLengthExceeded

_SLOT = re.compile(r"(\{query\}|\{document\})")


def pair_tokens(engine, fmt: RerankFormat, query: str, document: str, max_doc_tokens: int | None = None) -> list[int]:
    """The prompt tokens of one pair; ``max_doc_tokens`` cuts the document's own tokens first."""

    def text(s: str) -> list[int]:
        return engine.tokenize(s, add_special=False, parse_special=False) if s else []

    def cut(tokens: list[int]) -> list[int]:
        return tokens[:max_doc_tokens] if max_doc_tokens is not None else tokens

    if fmt.template is None:
        return [*fmt.prefix, *text(query), *fmt.middle, *cut(text(document)), *fmt.suffix]
    out: list[int] = []
    carry = ""  # a template piece's trailing whitespace, which the next text begins with
    for piece in _SLOT.split(fmt.template):
        if piece in ("{query}", "{document}"):
            tokens = text(carry + (query if piece == "{query}" else document))
            out.extend(cut(tokens) if piece == "{document}" else tokens)
            carry = ""
            continue
        piece = carry + piece
        body = piece.rstrip(" ")
        carry = piece[len(body):]
        if body:
            out.extend(engine.tokenize(body, add_special=False, parse_special=True))
    if carry:
        out.extend(engine.tokenize(carry, add_special=False, parse_special=True))
    return out


def check_fits(prompts: list[list[int]], ctx: int, what: str) -> None:
    """Every pair must fit the context: checked for all of them before the first is queued, so a
    long document late in the list costs nothing computed (``what`` names a pair in errors)."""
    for i, tokens in enumerate(prompts):
        if len(tokens) >= ctx:
            raise ContextLengthExceeded(f"{what}[{i}]: this model's maximum context length is {ctx} tokens, but "
                                        f"the pair (query and document in the reranker's prompt) has "
                                        f"{len(tokens)} tokens; cut the documents (max_tokens_per_doc) or "
                                        "send shorter ones", param=what)
