"""The CPU path's batched LoRA (kernels/cpu/lora.c) at every instruction set this CPU takes and for weights stored
in fp32, bf16 and fp16, against the torch forms of engine/lora/ops.py (grouped and masked, in fp32 on the same
stored values) and kernels/lora.py's reference: mixed slots with -1 tokens, fused projections whose B is
block-diagonal over uneven shards, ranks below the pool's, K and N off the vector width, more than one work item
per slot; and the engine's packed store (``PackedLoraSlots``) at each adapter's own rank per shard against the logical
layout. A token's result is the same bits whatever batch it is in and however many threads run (what a recorded
decode step relies on); bad slots, shard offsets, shapes and ranks are refused."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.lora.adapter import LoraShard
from engine.lora.pool import LoraWeights
from kernels import cpu_lora, cpu_quant_isa
from kernels.cpu_build import NativeKernelError
from kernels.lora import lora_add_ref
from tests.kernels.lora_cases import CASES, make_case, reference

ISAS = ("scalar", "avx2", "avx512")


def need(isa: str) -> None:
    if isa not in cpu_quant_isa.supported_isas():
        pytest.skip(f"this CPU lacks {isa} (it takes {', '.join(cpu_quant_isa.supported_isas())})")


def run(out, x, w, scaling, token_slots, isa):
    return cpu_lora.lora_add(out.clone(), x, w.a, w.bt, scaling, token_slots, w.shard_cols, isa=isa)


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-K{c[1]}-{len(c[2])}shards" for c in CASES])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("isa", ISAS)
def test_equals_the_torch_forms(case, weights, isa, two_threads):
    need(isa)
    out, x, w, scaling, token_slots = make_case(*case, weight_dtype=weights)
    got = run(out, x, w, scaling, token_slots, isa)
    for masked in (False, True):
        torch.testing.assert_close(got, reference(out, x, w, scaling, token_slots, masked), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, lora_add_ref(out.clone(), x, w.a, w.bt, scaling, token_slots, w.shard_cols),
                               rtol=1e-5, atol=1e-5)
    base = token_slots < 0
    assert torch.equal(got[base], out[base])  # the base model's tokens are not touched
    if not base.all():
        assert not torch.equal(got[~base], out[~base])


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_a_token_gets_the_same_bits_in_any_batch_and_thread_count(isa, weights):
    need(isa)
    out, x, w, scaling, token_slots = make_case(*CASES[2], weight_dtype=weights)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = run(out, x, w, scaling, token_slots, isa)
        torch.set_num_threads(1)
        assert torch.equal(run(out, x, w, scaling, token_slots, isa), full)
    finally:
        torch.set_num_threads(before)
    for t in (0, 3, 37, 69):  # alone (the rest padding: -1), as a recorded step's bucket pads a smaller batch
        alone = torch.full_like(token_slots, -1)
        alone[t] = token_slots[t]
        assert torch.equal(run(out, x, w, scaling, alone, isa)[t], full[t]), t
    shuffled = torch.randperm(len(token_slots), generator=torch.Generator().manual_seed(1))
    moved = run(out[shuffled], x[shuffled], w, scaling, token_slots[shuffled], isa)
    assert torch.equal(moved, full[shuffled])


def test_isas_agree_within_rounding():
    out, x, w, scaling, token_slots = make_case(*CASES[0])
    results = [run(out, x, w, scaling, token_slots, isa) for isa in cpu_quant_isa.supported_isas()]
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_by_name():
    out, x, w, scaling, token_slots = make_case(*CASES[0])
    with pytest.raises(ValueError, match=r"token_slots must be in \[-1, 3\)"):
        run(out, x, w, scaling, torch.full_like(token_slots, 3), None)
    with pytest.raises(ValueError, match=r"token_slots must be in"):
        run(out, x, w, scaling, torch.full_like(token_slots, -2), None)
    bad_cols = torch.tensor([0, 20, 29, 37])  # ends short of out's 38 columns
    with pytest.raises(ValueError, match="shard_cols must rise from 0 to out's 38"):
        cpu_lora.lora_add(out.clone(), x, w.a, w.bt, scaling, token_slots, bad_cols)
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        cpu_lora.lora_add(out.clone(), x.double(), w.a, w.bt, scaling, token_slots, w.shard_cols)
    with pytest.raises(TypeError, match="bt has dtype torch.bfloat16"):  # a and bt: one storage type
        cpu_lora.lora_add(out.clone(), x, w.a, w.bt.bfloat16(), scaling, token_slots, w.shard_cols)
    with pytest.raises(TypeError, match="out has dtype torch.bfloat16"):  # activations: fp32 only
        cpu_lora.lora_add(out.bfloat16(), x.bfloat16(), w.a, w.bt, scaling, token_slots, w.shard_cols)
    with pytest.raises(ValueError, match="bt has shape"):
        cpu_lora.lora_add(out.clone(), x, w.a, w.bt[:, :, :-1], scaling, token_slots, w.shard_cols)
    with pytest.raises(ValueError, match="token_slots has shape"):
        cpu_lora.lora_add(out.clone(), x, w.a, w.bt, scaling, token_slots[:-1], w.shard_cols)
    with pytest.raises(ValueError, match="shard_cols"):
        cpu_lora.lora_add(out.clone(), x, w.a, w.bt, scaling, token_slots, torch.tensor([0, 10, 20, 30, 38]))


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_slots_at_each_adapters_own_rank_equal_the_logical_layout(isa, weights, two_threads):
    """The engine's store (``PackedLoraSlots``, packed at each adapter's own rank per shard, nothing for an untargeted
    shard) against the logical layout of the same adapters (engine/lora/pool.py's zero-padded a / bt) and the
    reference: ranks below the pool's, a shard left out, a slot holding nothing in this projection."""
    need(isa)
    g = torch.Generator().manual_seed(3)
    k, shards, max_rank = 37, (20, 9, 9), 8
    adapters = [(5, None, 3), (8, 8, 8), (None, None, None), (1, 2, None)]
    pool = SimpleNamespace(max_loras=len(adapters), max_lora_rank=max_rank)
    logical = LoraWeights(pool, k, list(shards), torch.float32, "cpu")
    packed = cpu_lora.PackedLoraSlots(len(adapters), k, list(shards), max_rank, weights)
    for slot, ranks in enumerate(adapters):
        parts = {i: None if r is None else LoraShard(a=torch.randn(r, k, generator=g) / k ** 0.5,
                                                     b=torch.randn(n, r, generator=g))
                 for i, (n, r) in enumerate(zip(shards, ranks))}
        parts = {i: w if w is None else LoraShard(a=w.a.to(weights).float(), b=w.b.to(weights).float())
                 for i, w in parts.items()}  # the stored values, so both layouts hold the same numbers
        logical.write(slot, {i: w for i, w in parts.items() if w is not None})
        packed.write(slot, [None if w is None else (w.a, w.b) for w in parts.values()])
    assert packed.ranks.tolist() == [[r or 0 for r in ranks] for ranks in adapters]
    scaling = torch.rand(len(adapters), generator=g) + 0.5
    token_slots = torch.tensor([(-1, 0, 1, 2, 3, 0, 0, 1)[i % 8] for i in range(21)])
    x, out = torch.randn(21, k, generator=g), torch.randn(21, sum(shards), generator=g)
    got = packed.add_(out.clone(), x, scaling, token_slots, isa=isa)
    want = lora_add_ref(out.clone(), x, logical.a, logical.bt, scaling, token_slots, logical.shard_cols)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    untouched = (token_slots < 0) | (token_slots == 2)
    assert torch.equal(got[untouched], out[untouched])
    assert torch.equal(got[token_slots == 0][:, 20:29], out[token_slots == 0][:, 20:29])  # slot 0 skips shard 1


def test_slots_refuse_what_they_cannot_hold():
    slots = cpu_lora.PackedLoraSlots(2, 16, [8, 8], 4)
    with pytest.raises(ValueError, match="do not fit"):
        slots.write(0, [(torch.randn(5, 16), torch.randn(8, 5)), None])  # rank 5 > 4
    with pytest.raises(ValueError, match="do not fit"):
        slots.write(0, [(torch.randn(4, 15), torch.randn(8, 4)), None])  # 15 inputs
    with pytest.raises(ValueError, match="a projection of 2"):
        slots.write(0, [None])
    x, out, scaling = torch.randn(3, 16), torch.zeros(3, 16), torch.ones(2)
    with pytest.raises(ValueError, match="do not fit"):
        slots.add_(out, x.double(), scaling, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="do not fit"):
        slots.add_(out[:, :15], x, scaling, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"token_slots must be in \[-1, 2\)"):
        slots.add_(out, x, scaling, torch.full((3,), 2, dtype=torch.int64))
    slots.write(1, [(torch.randn(4, 16), torch.randn(8, 4)), None])
    slots.ranks[1, 1] = 9  # a store corrupted past its capacity: the C call's own check, also in a replayed step
    with pytest.raises(NativeKernelError, match="rank outside"):
        slots.add_(out, x, scaling, torch.ones(3, dtype=torch.int64))
