"""Scheduler bookkeeping without a model: tokens are 'sampled' as a fixed function of the step."""
from engine.kv.block_pool import BlockPool
from engine.kv.hashing import BlockHasher
from engine.request import Request, RequestStatus, SamplingParams
from engine.sched.scheduler import Scheduler

B = 4


def make(num_blocks=16, max_seqs=8, budget=64, chunked=True):
    pool = BlockPool(num_blocks)
    return pool, Scheduler(pool, BlockHasher(B), max_seqs, budget, chunked)


def req(rid, n_prompt, max_tokens=4, start=0):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens), seed=0)


def run_to_completion(pool, sched, max_steps=1000):
    steps = []
    for _ in range(max_steps):
        if not sched.num_unfinished:
            return steps
        out = sched.schedule()
        steps.append(out)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        for s in out.scheduled:  # every scheduled token fits in the request's blocks
            assert len(s.request.blocks) * B >= s.request.num_computed_tokens + s.num_new_tokens
        completing = [s for s in out.scheduled if s.completes_sequence]
        sched.on_step_computed(out)
        for s in completing:
            r = s.request
            r.append_output_token(7)
            sched.on_tokens_appended(r)
            if len(r.output_token_ids) >= r.params.max_tokens:
                sched.remove(r, RequestStatus.FINISHED_LENGTH)
        pool.check()
    raise AssertionError("did not finish")


def test_chunked_prefill_respects_budget():
    pool, sched = make(budget=8)
    r = req("a", 21, max_tokens=2)
    sched.add(r)
    steps = run_to_completion(pool, sched)
    assert [s.num_batched_tokens for s in steps] == [8, 8, 5, 1]
    assert pool.num_used_blocks == 0


def test_no_chunking_waits_for_budget():
    pool, sched = make(budget=8, chunked=False)
    sched.add(req("a", 9))
    assert sched.schedule().is_empty


def test_prefix_hit_skips_cached_blocks_and_recomputes_last_token():
    pool, sched = make()
    sched.add(req("a", 12, max_tokens=1))
    run_to_completion(pool, sched)
    b = req("b", 12, max_tokens=1)  # identical prompt: 3 full blocks cached, last token recomputed
    sched.add(b)
    out = sched.schedule()
    assert b.num_cached_prompt_tokens == 8 and out.scheduled[0].num_new_tokens == 4
    c = req("c", 14, max_tokens=1)  # shares 3 blocks, 2 new tokens
    sched.add(c)
    out = sched.schedule()
    assert c.num_cached_prompt_tokens == 12 and out.scheduled[-1].num_new_tokens == 2


def test_preemption_when_blocks_run_out_and_all_finish():
    pool, sched = make(num_blocks=6, budget=64)
    for i in range(3):
        sched.add(req(f"r{i}", 6, max_tokens=8, start=100 * i))
    run_to_completion(pool, sched)
    assert sched.num_preemptions > 0
    assert pool.num_used_blocks == 0


def test_max_num_seqs_caps_running():
    pool, sched = make(max_seqs=2)
    for i in range(5):
        sched.add(req(f"r{i}", 3, start=10 * i))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 3


def test_remove_waiting_and_running_frees_blocks():
    pool, sched = make()
    a, b = req("a", 9), req("b", 9, start=50)
    sched.add(a)
    sched.schedule()
    sched.add(b)
    sched.remove(a, RequestStatus.FINISHED_ABORTED)
    sched.remove(b, RequestStatus.FINISHED_ABORTED)
    assert sched.num_unfinished == 0 and pool.num_used_blocks == 0
    pool.check()
