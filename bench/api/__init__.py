"""bench.api: duet's API against references.

Pieces (each module's docstring is its design note):
- tool_calls.py       do enforced tool calls always parse and validate, at scale
- tool_repeats.py     how a tool-call list that only repeats is stopped: three rules measured (issue 46)
- lm_eval_compare.py  lm-evaluation-harness through `duet serve` vs its hf backend
- lm_eval_tasks/      the two lm-eval tasks and their data (no hub)
"""
