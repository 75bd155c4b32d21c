"""The fleet bench's chats: shared-prefix families, the burst's short questions, the agents' long
notes and the interactive chat. Pure text, so the unit tests can check their shape."""

from __future__ import annotations

from tools.bench.prompts import user_texts

TOPICS = ("billing service", "search index", "payments ledger", "mail relay", "image pipeline",
          "auth gateway", "metrics store", "job scheduler")
SENTENCE = ("Section {k}.{i}: the {topic} keeps a write-ahead log, replicates it to two peers "
            "and compacts it every night at {h:02d}:00. ")
TOKENS_PER_SENTENCE = 36  # about, with SmolLM2's tokenizer
NOTE = ("The quick brown fox jumps over the lazy dog while the committee reviews section {i} "
        "of the report on distributed systems, caching strategies and scheduling policies. ")
NOTE_TOKENS = 34
CHAT = "Say hello in five words."


def prefix(family: int, tokens: int) -> str:
    """The system prompt of family ``family``: about ``tokens`` tokens, distinct from the first
    words on (so a router's prefix tree tells the families apart at once)."""
    topic = TOPICS[family % len(TOPICS)]
    head = f"Design document {family} of the {topic}. Answer questions about it.\n"
    body = "".join(SENTENCE.format(k=family, i=i, topic=topic, h=(family * 7 + i) % 24)
                   for i in range(max(1, tokens // TOKENS_PER_SENTENCE)))
    return head + body


def family_messages(family: int, tokens: int, question: int) -> list[dict]:
    """One request of a family: its shared system prompt and a short question of its own."""
    return [{"role": "system", "content": prefix(family, tokens)},
            {"role": "user", "content": f"Question {question}: which peers hold section {family}.{question}?"}]


def affinity_requests(requests: int, families: int, tokens: int) -> list[tuple[int, list[dict]]]:
    """``requests`` (family, messages) pairs, families interleaved (0, 1, 2, 3, 0, ...), so a
    round-robin router hands every node every family."""
    return [(i % families, family_messages(i % families, tokens, i)) for i in range(requests)]


def burst_messages(n: int, tag: str) -> list[list[dict]]:
    """``n`` distinct short chats."""
    return [[{"role": "user", "content": t}] for t in user_texts(n, tag)]


def agent_messages(index: int, tokens: int) -> list[dict]:
    """A distinct long agent prompt of about ``tokens`` tokens."""
    body = "".join(NOTE.format(i=f"{index}.{k}") for k in range(max(1, tokens // NOTE_TOKENS)))
    return [{"role": "user", "content": f"Agent {index}: summarize the following notes.\n{body}"}]


def chat_messages() -> list[dict]:
    return [{"role": "user", "content": CHAT}]
