"""Speculative decoding: proposers guess the next tokens, the target checks them in one pass.

config.py (what the user asks for), ngram.py and draft.py (the proposers),
rejection.py (which guesses the target keeps), speculator.py (the engine's one entry point).
"""
