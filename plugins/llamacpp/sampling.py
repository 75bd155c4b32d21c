"""Per-lane samplers built from llama.cpp's own sampler chain, so greedy and seeded output are
what llama.cpp itself gives. Constraints, ``logit_bias`` and logprobs are applied to the logits row
before the chain sees it (``runner.LlamaCppRunner._sample``), by the rules every engine shares
(``superfluid.core.logits``, ``superfluid.core.constrain``)."""

from __future__ import annotations

import llama_cpp

from superfluid.core.request import SamplingParams


def build_sampler(params: SamplingParams, vocab):
    """A sampler chain in llama.cpp's usual order: penalties, top-k, top-p, min-p, temperature,
    dist (greedy: penalties, then the argmax)."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
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


def free_sampler(chain) -> None:
    if chain:
        llama_cpp.llama_sampler_free(chain)
