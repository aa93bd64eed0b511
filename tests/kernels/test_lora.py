"""The Triton batched LoRA (kernels/lora.py) against the torch forms of engine/lora/ops.py, in the interpreter on a
CPU (compiled on a GPU): fp32, and bf16 / fp16 models whose math runs in fp32 from the loads on (the output rounded
once; the interpreter's bf16 arithmetic would be wrong, so none is done in bf16), and an fp32 model whose adapters are
stored in bf16 (``lora_dtype``). Mixed slots with -1 tokens,
block-diagonal fused projections, ranks below the pool's; the reference ``lora_add_ref`` agrees with the engine's
forms; bad slots are refused where the values are checked (CPU tensors)."""
from __future__ import annotations

import pytest
import torch

from kernels import _triton_utils as tu
from kernels.lora import lora_add, lora_add_ref
from tests.kernels.lora_cases import CASES, make_case, reference

pytestmark = pytest.mark.skipif(not tu.triton_available("cuda" if torch.cuda.is_available() else "cpu"),
                                reason="Triton runs neither on a GPU nor in the interpreter here")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def on(device, *tensors):
    return [t.to(device, copy=True) for t in tensors]


@pytest.mark.parametrize("case", CASES[:3], ids=[f"T{c[0]}-K{c[1]}-{len(c[2])}shards" for c in CASES[:3]])
@pytest.mark.parametrize("dtype, weights", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                                            (torch.float32, torch.bfloat16)])
def test_equals_the_torch_forms(case, dtype, weights):
    out, x, w, scaling, token_slots = make_case(*case, dtype=dtype, weight_dtype=weights)
    d_out, d_x, a, bt, d_scaling, d_slots, cols = on(DEVICE, out, x, w.a, w.bt, scaling, token_slots, w.shard_cols)
    got = lora_add(d_out, d_x, a, bt, d_scaling, d_slots, cols).cpu()
    assert got.dtype == dtype
    want = reference(out, x, w, scaling, token_slots)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    base = token_slots < 0
    assert torch.equal(got[base], out[base])  # the base model's tokens are not touched
    assert not torch.equal(got[~base], out[~base])


def test_reference_is_the_engine_forms():
    for case in CASES:
        out, x, w, scaling, token_slots = make_case(*case)
        ref = lora_add_ref(out.clone(), x, w.a, w.bt, scaling, token_slots, w.shard_cols)
        for masked in (False, True):
            torch.testing.assert_close(ref, reference(out, x, w, scaling, token_slots, masked), rtol=1e-5, atol=1e-5)


def test_bad_slots_are_refused_on_checked_tensors():
    out, x, w, scaling, token_slots = make_case(*CASES[0])
    out, x, a, bt, scaling, token_slots, cols = on(DEVICE, out, x, w.a, w.bt, scaling, token_slots, w.shard_cols)
    with pytest.raises(ValueError, match=r"token_slots must be in \[-1, 3\)"):
        lora_add(out, x, a, bt, scaling, torch.full_like(token_slots, 5), cols)
    with pytest.raises(ValueError, match="shard_cols"):
        lora_add(out, x, a, bt, scaling, token_slots, torch.tensor([0, 20, 29, 40], device=DEVICE))
