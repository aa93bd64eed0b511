"""Speculative decoding (issue 28), decode side.

- :mod:`engine.spec.targets`: the target distribution at every verified position — what engine/sampler.py
  would sample from there, with the drafts before the position counted as generated.
- :mod:`engine.spec.rejection`: the verification sampler (pure function of logits, drafts and the requests'
  seeds): greedy token-exact, sampled lossless in distribution.
- :mod:`engine.spec.proposers`: the proposer interface and per-request state rebuilt from tokens;
  :mod:`engine.spec.ngram` (prompt lookup), :mod:`engine.spec.suffix` (suffix decoding with a worker cache).
- :mod:`engine.spec.draft`: a draft model (a second checkpoint of the target's vocabulary) with its KV in
  blocks indexed like the target's.
- :mod:`engine.spec.policy`: how many drafts pay per sequence and step; :mod:`engine.spec.decoder`: all of it
  wired into the engine's step.
- :mod:`engine.spec.config`: ``--speculative-config`` as vLLM users write it.
"""
