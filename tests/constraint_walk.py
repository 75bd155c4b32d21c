"""Walking a text through a constraint's token masks, as an engine samples: shared by the tests
of core/constrain.py and of forced tool calls."""

from __future__ import annotations


def tokens_of(vocab, text: str) -> list[int]:
    import llama_cpp

    raw = text.encode()
    buf = (llama_cpp.llama_token * (len(raw) + 8))()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, False)
    return list(buf[:n])


def takes(constrainer, vocab, sampling, text: str) -> bool:
    """Whether the masks let ``text`` through token by token (each checked before it is
    accepted) and then let the generation end."""
    lane = constrainer.for_lane(sampling)
    assert lane is not None and not lane.matcher.is_error(), "llguidance rejected the constraint"
    for token in tokens_of(vocab, text):
        if not lane.allowed()[token]:
            return False
        lane.accept(token)
    return bool(lane.allowed()[constrainer.eos[0]])
