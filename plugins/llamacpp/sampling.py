"""Per-lane samplers built from llama.cpp's own sampler chain, so greedy and seeded output are
what llama.cpp itself gives."""

from __future__ import annotations

import logging

import llama_cpp

from superfluid.core.request import SamplingParams

from .grammar import grammar_text

log = logging.getLogger("superfluid.llamacpp")


def grammar_sampler(vocab, grammar: str):
    """llama.cpp's GBNF sampler for ``grammar`` (root rule ``root``), or None if llama.cpp
    rejects the grammar (it says why on stderr)."""
    smpl = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    return smpl or None


def build_sampler(params: SamplingParams, vocab):
    """A sampler chain in llama.cpp's usual order: grammar, penalties, top-k, top-p, min-p,
    temperature, dist. The grammar, if any, is the chain's first sampler (index 0), so a caller can
    feed prompt tokens to the others only (see :func:`accept_prompt`). The grammar is the
    request's own or the one its JSON constraint converts to (:mod:`.grammar`); one llama.cpp
    rejects is left out with a warning rather than failing the tick."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
    grammar = grammar_text(params)
    if grammar:
        smpl = grammar_sampler(vocab, grammar)
        if smpl is None:
            log.warning("llama.cpp rejected a request's grammar; sampling it unconstrained")
        else:
            add(smpl)
    if params.uses_penalties:
        # the vendored llama.cpp still takes the vocabulary's size first
        add(llama_cpp.llama_sampler_init_penalties(llama_cpp.llama_vocab_n_tokens(vocab), params.penalty_last_n,
                                                   params.repeat_penalty, params.frequency_penalty,
                                                   params.presence_penalty))
    if params.greedy:
        add(llama_cpp.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        add(llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
    add(llama_cpp.llama_sampler_init_temp(params.temperature))
    seed = llama_cpp.LLAMA_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
    add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


def has_grammar(chain, params: SamplingParams) -> bool:
    """Whether ``build_sampler`` put a grammar at the head of this chain."""
    return params.constrained and llama_cpp.llama_sampler_chain_n(chain) > 0 and llama_cpp.llama_sampler_name(
        llama_cpp.llama_sampler_chain_get(chain, 0)) == b"grammar"


def accept_prompt(chain, token: int) -> None:
    """Feed a prompt token to every sampler of a grammar chain but the grammar (it constrains
    the generated text only)."""
    for i in range(1, llama_cpp.llama_sampler_chain_n(chain)):
        llama_cpp.llama_sampler_accept(llama_cpp.llama_sampler_chain_get(chain, i), token)


def free_sampler(chain) -> None:
    if chain:
        llama_cpp.llama_sampler_free(chain)
