"""Speculative decoding (issue 28), decode side.

- :mod:`engine.spec.targets`: the target distribution at every verified position — what engine/sampler.py
  would sample from there, with the drafts before the position counted as generated.
- :mod:`engine.spec.rejection`: the verification sampler (pure function of logits, drafts and the requests'
  seeds): greedy token-exact, sampled lossless in distribution.
"""
