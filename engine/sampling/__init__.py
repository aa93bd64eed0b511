"""engine.sampling: from logits to the next token.

Pieces (each module's docstring is its design note):
- sampler.py     greedy, temperature, top-k, top-p, seeds, logprobs
- structured.py  structured output: JSON, JSON Schema, regex, choice, Lark / GBNF grammars as token masks
- call_lists.py  tool-call lists in grammar-held output: their calls as they arrive, the end at a repeated call
"""
