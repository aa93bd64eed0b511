"""The compiled (GPU) path of every kernel builds for sm_90 and does not spill: see sm90_compile.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_kernel_compiles_for_h100_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the stand-in driver, even on a GPU machine
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=540)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    problems = [r for r in rows if "error" in r or r.get("spills")]
    assert done.returncode == 0 and not problems, (problems, done.stderr[-3000:])
    kernels = {r["kernel"] for r in rows if "kernel" in r}
    assert kernels == {"_store_kv_kernel", "_decode_partition_kernel", "_decode_reduce_kernel",
                       "_prefill_attention_kernel", "_gemm_kernel", "_rms_norm_kernel", "_rotary_kernel",
                       "_silu_mul_kernel", "_moe_gemm_kernel", "_quant_gemm_kernel", "_quant_rows_kernel",
                       "_lora_shrink_kernel", "_lora_expand_kernel"}
    cases = {r["case"] for r in rows if "kernel" in r}
    assert {"decode softcap bf16", "prefill softcap bf16", "fused_moe bf16 T=1", "rotary partial bf16",
            "quant_gemm Q4_0 torch.bfloat16 M=1", "quant_gemm Q6_K torch.float16 M=200",
            "quant_gemm G4 act-order torch.bfloat16 M=16", "quant_rows Q4_K bf16", "decode softcap int8 bf16",
            "lora torch.bfloat16 T=16", "lora torch.bfloat16 T=256"} <= cases
    # a quantized KV cache: the store and both attention kernels for each value dtype
    for kv, dtype in (("int8", "bfloat16"), ("fp8_e4m3", "bfloat16"), ("fp8_e5m2", "float16"), ("int8", "float32")):
        for kernel in ("decode split", "decode single", "prefill", "prefill fresh", "store_kv"):
            assert any(c.startswith(f"{kernel} {kv} torch.{dtype} ") for c in cases), (kernel, kv, dtype)
    # the quantized store writes torch's bytes: correctly rounded fp32 divisions only (a plain `/` is div.full.f32)
    stores = [r for r in rows if r.get("kernel") == "_store_kv_kernel" and r["case"].split()[1] in ("int8", "fp8_e4m3",
                                                                                                    "fp8_e5m2")]
    assert len(stores) == 4 and all(r["div_rn"] > 0 and r["div_approx"] == 0 for r in stores), stores
    assert rows[-1]["compiled"] >= 20
