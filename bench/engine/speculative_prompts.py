"""Prompts for ``make bench-spec`` (bench/engine/speculative.py), built offline: no dataset hub.

- **Input-grounded**: tasks whose answer copies or edits text given in the prompt — repeat it, correct its
  spelling, summarise it — over paragraphs of Python's own reference documentation (``pydoc_data.topics``:
  English prose with code, shipped with every CPython, so the same text on every machine).
- **Open chat**: questions whose answers are not in the prompt.

Each list is deterministic; :func:`prompts` returns the first ``n`` of a workload, the ones after it for warm-up.
"""
from __future__ import annotations

import random

TOPICS = ("assert", "assignment", "augassign", "break", "calls", "class", "comparisons", "continue", "del",
          "dict", "exceptions", "for", "function", "global", "if", "import", "lambda", "lists", "nonlocal",
          "pass", "raise", "return", "try", "while", "with", "yield", "booleans", "slicings")

CHAT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for staying healthy while working from home?",
    "Explain how a rainbow forms, in simple terms.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "Why do cats purr? Give a few possible reasons.",
    "Describe a perfect autumn day in a small village.",
    "What should I pack for a weekend hiking trip?",
    "Write a friendly email inviting my neighbours to a garden party.",
    "How does a bicycle stay upright when it moves?",
    "Suggest some names for a new coffee shop and explain each one.",
    "What is the difference between weather and climate?",
    "Write a poem about the sea at night.",
    "How can I get better at remembering people's names?",
    "Explain what a volcano is to a ten-year-old.",
    "What are some fun things to do on a rainy afternoon?",
    "Tell me about the history of tea in a few paragraphs.",
    "How do bees make honey?",
    "Give advice to someone starting their first job.",
    "Describe the life cycle of a butterfly.",
    "What makes a good friend?",
    "Write a short dialogue between a robot and a gardener.",
    "Why is the sky blue?",
    "Plan a one-day tour of a city you like.",
    "What are the benefits of learning a second language?",
)


def paragraph(topic: str, max_words: int = 160) -> str:
    """The first ``max_words`` words of a reference topic, cut at the next sentence end (at most half as many
    words again)."""
    from pydoc_data.topics import topics

    lines = [ln for ln in topics[topic].splitlines() if ln.strip() and not set(ln.strip()) <= set("*=-")]
    words, out = 0, []
    for ln in lines[1:]:  # the first line is the title
        out.append(ln)
        words += len(ln.split())
        if words >= max_words and ln.rstrip().endswith((".", ":")) or words >= 1.5 * max_words:
            break
    return "\n".join(out)


def misspell(text: str, seed: int, rate: float = 0.08) -> str:
    """``text`` with ~``rate`` of its longer words given a typo (two letters swapped)."""
    rng = random.Random(seed)
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 4 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def grounded(max_words: int = 160) -> list[str]:
    out = []
    for i, topic in enumerate(TOPICS):
        text = paragraph(topic, max_words)
        kind = i % 3
        if kind == 0:
            out.append(f"Repeat the following text exactly, word for word.\n\n{text}")
        elif kind == 1:
            out.append("Rewrite the following text with its spelling mistakes corrected. Change nothing else.\n\n"
                       + misspell(text, seed=i))
        else:
            out.append(f"Summarise the following text in a few sentences, reusing its wording.\n\n{text}")
    return out


WORKLOADS = {"input-grounded": grounded, "open-chat": lambda max_words: list(CHAT)}


def prompts(workload: str, n: int, warmup: int = 2, max_words: int = 160) -> tuple[list[str], list[str]]:
    """(the ``n`` measured prompts, ``warmup`` other ones) of a workload; input-grounded paragraphs of about
    ``max_words`` words."""
    all_prompts = WORKLOADS[workload](max_words)
    if n + warmup > len(all_prompts):
        raise ValueError(f"{workload} has {len(all_prompts)} prompts, {n} + {warmup} asked")
    return all_prompts[:n], all_prompts[n:n + warmup]
