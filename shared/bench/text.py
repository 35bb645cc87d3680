"""Synthetic but readable text from a fixed word list, so workloads need no download.

Lengths are in tokens as a server would count them, approximated as words times
TOKENS_PER_WORD: these common words cost about 1.08 tokens each through SmolLM2's BPE
tokenizer (measured over 5,000 generated words; Llama-family tokenizers are close). The
server's `usage` reports the real count; this only steers the generator.
"""

from __future__ import annotations

import random

TOKENS_PER_WORD = 1.08

_WORD_LIST = """
the of and to in is was for on that with as by at from his her it an are were which be
this had not or have one their has but all who they been more when first its new after
two also other time many year years some can would she there about into over most city
only part during where later made these used under state may such while world between
known war three then both through region river system water power light energy heat
machine engine model data network server request token cache memory block layer queue
worker router cluster rack cooling pump valve flow pressure signal voltage current load
battery sensor storage market price trade policy law court school student teacher book
story history music film song garden forest mountain island ocean weather winter summer
morning evening family friend doctor patient village bridge road train station harbor
ship captain letter message answer question reason method result value number table
chapter section paper report design plan project team leader member group service field
simple careful quick slow bright dark large small early late strong gentle ancient modern
build write read carry follow explain measure compare choose open close begin finish
"""
WORDS = _WORD_LIST.split()

QUESTIONS = [
    "Explain in detail how {a} relates to {b}.",
    "Write a short story about a {a} and a {b}.",
    "Summarize the history of the {a} in a few paragraphs.",
    "List the main differences between a {a} and a {b}.",
    "What would happen to the {a} if the {b} stopped working?",
    "Describe a typical day for someone who studies the {a}.",
]


def words(rng: random.Random, n: int) -> str:
    """`n` words as sentences of 8 to 16 words, capitalised and full-stopped."""
    out: list[str] = []
    while len(out) < n:
        size = min(rng.randint(8, 16), n - len(out))
        sentence = [rng.choice(WORDS) for _ in range(size)]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out.extend(sentence)
    return " ".join(out)


def text_of_tokens(rng: random.Random, tokens: int) -> str:
    return words(rng, max(1, round(tokens / TOKENS_PER_WORD)))


def question(rng: random.Random) -> str:
    return rng.choice(QUESTIONS).format(a=rng.choice(WORDS), b=rng.choice(WORDS))
