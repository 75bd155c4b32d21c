"""llguidance's view of a llama.cpp vocabulary, for constrained lanes (core.constrain)."""

from __future__ import annotations

import warnings

import llama_cpp

from superfluid.core.constrain import Constrainer


def end_tokens(vocab, n_vocab: int) -> list[int]:
    """Every end-of-generation token (a chat model's end-of-turn as well as its EOS): a complete
    constrained reply may end with any of them."""
    return [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]


def constrainer(vocab, n_vocab: int) -> Constrainer:
    from llguidance.llamacpp import lltokenizer_from_vocab

    eos = end_tokens(vocab, n_vocab) or [llama_cpp.llama_vocab_eos(vocab)]
    with warnings.catch_warnings():  # it asks llama_token_get_attr, deprecated, once per token
        warnings.simplefilter("ignore", DeprecationWarning)
        tokenizer = lltokenizer_from_vocab(vocab, eos_token=eos)
    return Constrainer(tokenizer, n_vocab, tuple(eos))
