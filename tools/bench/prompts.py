"""The workload: distinct coding/explanation prompts as raw ChatML.

Raw ChatML goes to /v1/completions so no server's chat template rendering is part of
the comparison. Every prompt in a round is distinct, and by default every round gets
a fresh tag at the start of the user text, so no prefix cache can answer a prefill
from an earlier round.
"""

from __future__ import annotations

PROMPTS: tuple[str, ...] = (
    "Write a Python function that merges two sorted lists into one sorted list, "
    "and explain its time complexity.",
    "Explain how a hash map handles collisions, comparing chaining with open addressing.",
    "Write a C function that reverses a singly linked list in place, with comments.",
    "Explain the difference between a process and a thread, with an example of when "
    "to use each.",
    "Write a SQL query that finds the second highest salary in an employees table, "
    "and explain how it works.",
    "Explain what a race condition is and show how a mutex prevents one in Go.",
    "Write a JavaScript debounce function and explain where it is useful.",
    "Explain how garbage collection works in a generational collector.",
    "Write a Rust function that counts word frequencies in a string using a HashMap.",
    "Explain the CAP theorem and what it means for the design of a distributed database.",
    "Write a binary search in Java and explain the off-by-one errors it avoids.",
    "Explain how TCP's three-way handshake works and why it needs three steps.",
    "Write a Python generator that yields the Fibonacci numbers, and explain lazy "
    "evaluation.",
    "Explain what a B-tree is and why databases use it for indexes.",
    "Write a shell script that finds the ten largest files under a directory.",
    "Explain the difference between optimistic and pessimistic locking.",
)


def chatml(user_text: str) -> str:
    """One user turn, ending where the assistant's reply begins."""
    return f"<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n"


def user_texts(n: int, tag: str | None = None) -> list[str]:
    """``n`` distinct user messages; ``tag`` (e.g. a round id) leads each one.

    Beyond the built-in list, prompts repeat with a numbered lead-in so they stay
    distinct from their first character on.
    """
    out = []
    for i in range(n):
        text = PROMPTS[i % len(PROMPTS)]
        if i >= len(PROMPTS):
            text = f"Variant {i // len(PROMPTS)}. {text}"
        if tag:
            text = f"[{tag}.{i}] {text}"
        out.append(text)
    return out


def completion_prompts(n: int, tag: str | None = None) -> list[str]:
    """``n`` distinct raw-ChatML prompts for /v1/completions."""
    return [chatml(t) for t in user_texts(n, tag)]
