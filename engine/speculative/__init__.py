"""Speculative decoding: proposers of token trees, their verification, the adaptive policy.

``config.py``, ``policy.py`` and ``ngram.py`` are pure Python; ``draft.py`` runs a second
model; ``speculator.py`` is what the engine calls around each step.
"""
