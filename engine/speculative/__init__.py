"""engine.speculative: speculative decoding (issue 28), decode side. A sibling of sampling/, not a child: draft.py
imports the model runner and decoder.py the scheduler's output. Its config is engine/config.py's SpeculativeConfig.

Pieces (each module's docstring is its design note):
- decoder.py    SpecDecoder: drafts proposed before a step, verified by it; make_proposer
- proposers.py  the Proposer interface and per-request state rebuilt from tokens
- ngram.py      n-gram (prompt lookup) proposer
- suffix.py     suffix decoding proposer, with a worker cache of finished outputs
- draft.py      a draft model with its KV in blocks indexed like the target's
- policy.py     how many drafts pay per sequence and step
- rejection.py  the verification sampler: greedy token-exact, sampled lossless in distribution
- targets.py    the target distribution at every verified position
"""
