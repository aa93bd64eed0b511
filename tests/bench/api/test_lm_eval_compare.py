"""lm-evaluation-harness scores SmolLM2 through `duet serve` exactly as through its own ``hf`` backend.

bench/api/lm_eval_compare.py end to end on the first documents of both local tasks (multiple choice by
log-likelihood, and greedy generation to a newline): lm-eval's ``hf`` backend on the fp32 directory, then its
``local-completions`` backend against a `duet serve` with 1 prefill + 1 decode worker on that same directory,
4 token-id prompts per /v1/completions request (log-likelihoods from ``echo`` + ``logprobs`` with
``max_tokens: 1``). Every metric must be equal, and so must every document's outcome (its per-document
scores and the chosen answer or generated text).
"""
from __future__ import annotations

import pytest

from bench.api.lm_eval_compare import TASKS, compare, format_comparison, run_backends

pytestmark = pytest.mark.slow
LIMIT = 8  # documents per task: 32 log-likelihood requests and 8 generations per backend


@pytest.mark.soak  # ~80 s here: `make soak` (and `make eval-compare` runs the comparison in full)
def test_lm_eval_local_completions_on_duet_equals_hf_backend(tmp_path):
    runs = run_backends(tmp_path, limit=LIMIT, batch_size=4)
    cmp = compare(runs["hf"], runs["duet"])
    report = format_comparison(cmp)
    print(report)
    assert {task for task, _, _, _ in cmp.rows} == set(TASKS), report
    assert cmp.num_docs == LIMIT * len(TASKS), report
    assert cmp.all_equal, report
    assert not cmp.doc_diffs, report


def test_a_quantized_kv_run_is_held_within_the_reference_stderr():
    """``--kv-cache-dtype``'s check (no server): a metric holds when |hf - duet| <= lm-eval's stderr of hf's, or,
    where lm-eval reports N/A, its mean_stderr over the documents' 0/1 scores, sqrt(p (1 - p) / (n - 1))."""
    from bench.api.lm_eval_compare import within_stderr

    samples = {"duet_mc": [{}] * 40, "duet_short_answer": [{}] * 20}
    hf = {"results": {"duet_mc": {"acc,none": 0.6, "acc_stderr,none": "N/A", "acc_norm,none": 0.55,
                                  "acc_norm_stderr,none": 0.01},
                      "duet_short_answer": {"exact_match,strip": 0.55, "exact_match_stderr,strip": "N/A"}},
          "samples": samples}
    duet = {"results": {"duet_mc": {"acc,none": 0.575, "acc_norm,none": 0.525},
                        "duet_short_answer": {"exact_match,strip": 0.3}}, "samples": samples}
    rows = {(t, m): (err, ok) for t, m, _, _, err, ok in within_stderr(hf, duet)}
    assert abs(rows[("duet_mc", "acc,none")][0] - (0.6 * 0.4 / 39) ** 0.5) < 1e-12 and rows[("duet_mc", "acc,none")][1]
    assert rows[("duet_mc", "acc_norm,none")] == (0.01, False)  # lm-eval's own stderr, and 0.025 is beyond it
    assert not rows[("duet_short_answer", "exact_match,strip")][1]  # 0.25 off, stderr 0.114
