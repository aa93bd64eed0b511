"""kernels/quant.py ``quantize_ref`` (``quantization: int8 | int4`` at load) against gguf-py's quantizers, the reference
nobody here wrote: the same bytes, block for block, on Gaussian weights and on the edge cases of the rules (an all-zero
block, a constant block, halves that round away from zero, a block whose range is one value)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels.quant import QUANTIZE_FORMATS, QuantWeight, dequantize_ref, quantize_ref


def weights() -> torch.Tensor:
    w = torch.randn(37, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    w[0, :32] = 0.0  # d = 0: every quant 0
    w[1, :32] = 0.75  # constant: Q4_1's range is 0
    w[2, :32] = (torch.arange(32) - 16) * 0.5  # halves: round-to-nearest ties (away from zero in Q8_0)
    w[3, 32:64] = torch.tensor([-1.0, 1.0] * 16)  # two values
    w[4, 64:] = -1e-30  # tiny, negative
    return w


@pytest.mark.parametrize("fmt", QUANTIZE_FORMATS)
def test_quantize_ref_is_gguf_bit_exactly(fmt):
    w = weights()
    ours = quantize_ref(w, fmt)
    assert isinstance(ours, QuantWeight) and ours.fmt == fmt and (ours.rows, ours.cols) == (37, 96)
    assert np.array_equal(ours.data.numpy(), gguf.quantize(w.numpy(), gguf.GGMLQuantizationType[fmt]))
    # round to nearest: within half a step per block, plus the fp16 rounding of the scale (and min) times the quant
    err = (dequantize_ref(ours) - w).abs().reshape(37, 3, 32).amax(-1)
    blocks = w.reshape(37, 3, 32)
    step = blocks.abs().amax(-1) / 127 if fmt == "Q8_0" else (blocks.amax(-1) - blocks.amin(-1)) / 15
    assert torch.all(err <= step * (0.5 + 127 * 2 ** -11) + blocks.abs().amax(-1) * 2 ** -11 + 1e-30)


def test_quantize_ref_refuses_what_it_does_not_make():
    with pytest.raises(ValueError, match="quantize_ref makes Q8_0, Q4_1, not 'Q4_K'"):
        quantize_ref(torch.zeros(2, 32), "Q4_K")
    with pytest.raises(ValueError, match="cols a multiple of 32, got 48"):
        quantize_ref(torch.zeros(2, 48), "Q8_0")
