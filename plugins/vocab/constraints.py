"""The token masks of constrained lanes (``json_schema`` / ``grammar``) for an engine that
samples in Python (MLX in its worker, basert in the daemon): core's
:class:`~superfluid.core.constrain.Constrainer` over an llguidance tokenizer of the model's own
vocabulary, built once per model (about half a second for a 49,152-token vocabulary).

For a GGUF the tokenizer is llguidance's from llama.cpp's vocab (``llguidance.llamacpp``): the
token bytes are llama.cpp's pieces, control tokens are marked special (a 0xff prefix) so no
grammar can spell them, and llguidance tokenizes through llama.cpp itself, so its token
boundaries are the ones the daemon's tokenizer makes. The vocab-only load it needs is opened where
the sampling runs (the daemon's cannot cross a process boundary) and stays open while the
tokenizer lives. For an mlx-lm directory it is llguidance's from the directory's fast Hugging Face
tokenizer, as mlx-lm loads it."""

from __future__ import annotations

import warnings

from superfluid.core.constrain import Constrainer

from . import GGUFVocab, HFVocab, open_vocab


class VocabConstrainer(Constrainer):
    """A Constrainer that owns the vocabulary its tokenizer reads (closed with it)."""

    def __init__(self, path: str, n_vocab: int | None, eog: set[int] | frozenset[int]):
        """``n_vocab``: the length of the model's logits row (None: the vocabulary's size)."""
        self.vocab = open_vocab(path, "constraints")
        n_vocab = n_vocab or self.vocab.n_vocab
        super().__init__(lltokenizer(self.vocab, n_vocab), n_vocab, tuple(sorted(eog)))

    def close(self) -> None:
        self.vocab.close()


def lltokenizer(vocab: GGUFVocab | HFVocab, n_vocab: int):
    """llguidance's tokenizer for a vocabulary, its rows padded to ``n_vocab`` (the logits row:
    a model may have more rows than tokens)."""
    if isinstance(vocab, HFVocab):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(vocab.tok, n_vocab=n_vocab)
    import llguidance.llamacpp

    with warnings.catch_warnings():  # it reads token attributes through a deprecated alias, per token
        warnings.simplefilter("ignore", DeprecationWarning)
        return llguidance.llamacpp.lltokenizer_from_vocab(vocab._vocab, n_vocab=n_vocab)
