"""Compile every launcher's kernels for an H100 (sm_90) without a GPU, and report registers and spills.

Run as ``python -m tests.kernels.sm90_compile`` *without* TRITON_INTERPRET (test_sm90_compile.py does so in a
subprocess). The interpreter accepts things the GPU compiler refuses (a ``tl.dot`` with a dim < 16, a while
loop whose carried value changes type, too much shared memory), so this is the CPU-side guard for the
compiled path. A stand-in Triton driver reports an sm_90 target, compiles with the ptxas that ships with
Triton, reads registers and spill stores from the cubin with the bundled cuobjdump, and launches nothing.
Tensors live on the CPU: only their dtypes, strides and alignment reach the compiler.

Prints one JSON line per compiled kernel; exits 1 if any kernel fails to compile, or spills registers to local
memory in fp16/bf16 (fp32 is a correctness path, not a fast one). Each line also counts the fp32 divisions in the
kernel's PTX by rounding: ``div_rn`` (IEEE, correctly rounded) and ``div_approx`` (``div.full`` / ``div.approx``,
what a plain ``/`` compiles to): the quantized KV store must write the torch reference's bytes, so it may only
hold the first kind (kernels/store_kv.py).
By default a representative subset (every kernel and config branch, ~45 compilations); ``--all`` compiles
every dtype x head_dim x GQA ratio x M combination (minutes).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

H100 = GPUTarget("cuda", 90, 32)
H100_SHARED_BYTES = 232448
RESULTS: list[dict] = []
_DIVISIONS: dict[str, dict] = {}  # kernel name -> the fp32 divisions of its latest compiled PTX


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": H100_SHARED_BYTES, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1, "mem_clock_rate": 1, "mem_bus_width": 1}

    def load_binary(self, name, cubin, shared, device):
        usage = _resource_usage(cubin)
        RESULTS.append({"kernel": name, "shared_bytes": shared, **usage, **_DIVISIONS.pop(name, {})})
        return None, None, usage["registers"], usage["spill_stores"], 1024


class _CompileOnlyDriver:
    utils = _Utils()

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return H100

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None


def _resource_usage(cubin: bytes) -> dict:
    """Registers from the cubin's resource table; spills = local-memory stores (STL) in its SASS."""
    tool = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return {"registers": int(re.search(r"\bREG:(\d+)", usage).group(1)),
            "spill_stores": len(re.findall(r"\bSTL(?:\.\w+)*\s", sass))}


def _count_divisions(*, key, fn, compile, **_) -> None:
    """jit_post_compile_hook: the fp32 divisions in the PTX of the kernel just compiled, by rounding."""
    ptx = fn.jit_function.device_caches[compile["device"]][0][key].asm["ptx"]
    _DIVISIONS[fn.name] = {"div_rn": len(re.findall(r"\bdiv\.rn(?:\.ftz)?\.f32", ptx)),
                           "div_approx": len(re.findall(r"\bdiv\.(?:full|approx)(?:\.ftz)?\.f32", ptx))}


def _cases(full: bool):
    """(label, thunk) for the configs each launcher picks at serving shapes; ``full`` = every combination."""
    from kernels import decode_attention as da
    from kernels import fused as fu
    from kernels import fused_moe as fm
    from kernels import gemm
    from kernels import lora as lo
    from kernels import prefill_attention as pa
    from kernels import store_kv as sk

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    if full:
        attention = [(dt, d, h) for dt in (bf16, fp16, fp32) for d in (64, 80, 96, 128)
                     for h in ((32, 8), (8, 8), (28, 4), (16, 1))]
        gemms = [(dt, m, g) for dt in (bf16, fp16, fp32) for m in (1, 16, 64, 256, 2048)
                 for g in ((None, 1, 32) if dt != fp32 else (None,))]
    else:  # every kernel, every config branch, the main head dims and GQA shapes
        attention = [(bf16, 128, (32, 8)), (fp16, 80, (16, 1)), (fp32, 64, (28, 4))]
        gemms = [(bf16, 1, None), (bf16, 16, None), (bf16, 64, None), (bf16, 256, None), (bf16, 2048, None),
                 (bf16, 16, 32), (fp16, 2048, 1), (bf16, 2048, 32)]

    def paged(dtype, head_dim, q_heads, kv_heads, q_tokens, seq_lens, block_size=16):
        kv = torch.zeros(64, 2, 2, block_size, kv_heads, head_dim, dtype=dtype)
        tables = torch.arange(len(seq_lens) * 64, dtype=torch.int32).view(len(seq_lens), 64) % 64
        q = torch.zeros(q_tokens, q_heads, head_dim, dtype=dtype)
        return q, kv[:, 1, 0], kv[:, 1, 1], tables, torch.tensor(seq_lens, dtype=torch.int32)

    for dtype, head_dim, (q_heads, kv_heads) in attention:
        label = f"{dtype} d={head_dim} h={q_heads}/{kv_heads}"
        q, kc, vc, bt, sl = paged(dtype, head_dim, q_heads, kv_heads, 2, [700, 1000])
        yield f"decode split {label}", lambda: da._paged_decode_attention(
            q, kc, vc, bt, sl, 0.1, None, partition_size=512)
        yield f"decode single {label}", lambda: da._paged_decode_attention(
            q, kc, vc, bt, sl, 0.1, 64, partition_size=1024)
        q, kc, vc, bt, sl = paged(dtype, head_dim, q_heads, kv_heads, 300, [100, 200])
        cu = torch.tensor([0, 100, 300], dtype=torch.int32)
        yield f"prefill {label}", lambda: pa.prefill_attention(q, kc, vc, bt, cu, sl, 0.1, 128)
        k = torch.zeros(5, kv_heads, head_dim, dtype=dtype)
        yield f"store_kv {label}", lambda: sk.store_kv(k, k, kc, vc, torch.arange(5))
    # Gemma 2's soft-capped scores (a constexpr branch of both attention kernels)
    q, kc, vc, bt, sl = paged(bf16, 128, 16, 8, 2, [700, 1000])
    yield "decode softcap bf16", lambda: da._paged_decode_attention(q, kc, vc, bt, sl, 0.1, None,
                                                                   partition_size=512, softcap=50.0)
    q, kc, vc, bt, sl = paged(bf16, 128, 16, 8, 300, [100, 200])
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    yield "prefill softcap bf16", lambda: pa.prefill_attention(q, kc, vc, bt, cu, sl, 0.1, 128, softcap=50.0)
    for t in (1, 256):  # the fused MoE's decode and prefill configs (Qwen3-30B-A3B-like shapes, scaled down)
        gate_up, down = torch.zeros(16, 2 * 768, 2048, dtype=bf16), torch.zeros(16, 2048, 768, dtype=bf16)
        x, w = torch.zeros(t, 2048, dtype=bf16), torch.zeros(t, 4)
        ids = torch.zeros(t, 4, dtype=torch.int64)
        yield f"fused_moe bf16 T={t}", lambda: fm.fused_moe(x, w, ids, gate_up, down)
    qkv, table = torch.zeros(8, 48 * 128, dtype=bf16), torch.zeros(4096, 96)
    yield "rotary partial bf16", lambda: fu.rotary_(qkv, 40, 128, torch.zeros(8, dtype=torch.long), table, table,
                                                   rotary_dim=96)
    for dtype in (bf16, fp32):
        x = torch.zeros(8, 4096, dtype=dtype)
        yield f"rms_norm {dtype}", lambda: fu.rms_norm(x, torch.ones(4096, dtype=dtype), 1e-5, torch.zeros_like(x))
        qkv, table = torch.zeros(8, 48 * 128, dtype=dtype), torch.zeros(4096, 128)
        yield f"rotary {dtype}", lambda: fu.rotary_(qkv, 40, 128, torch.zeros(8, dtype=torch.long), table, table)
        yield f"silu_mul {dtype}", lambda: fu.silu_mul(torch.zeros(8, 2 * 11008, dtype=dtype))
    for dtype, t in ((bf16, 16), (bf16, 256), (fp32, 16)):  # LoRA on a fused q/k/v (8 slots of rank 16)
        x, out = torch.zeros(t, 4096, dtype=dtype), torch.zeros(t, 6144, dtype=dtype)
        a, bt = torch.zeros(8, 48, 4096, dtype=dtype), torch.zeros(8, 48, 6144, dtype=dtype)
        slots, cols = torch.arange(t) % 9 - 1, torch.tensor([0, 4096, 5120, 6144])
        yield f"lora {dtype} T={t}", lambda: lo.lora_add(out, x, a, bt, torch.ones(8), slots, cols)
    yield from _kv_quant_cases(full, paged)
    yield from _quant_cases(full)
    for dtype, m, groups in gemms:
        x = torch.zeros(m, 4096, dtype=dtype)
        if groups is None:
            w = torch.zeros(4096, 4096, dtype=dtype)
            yield f"gemm {dtype} M={m}", lambda: gemm.gemm(x, w, torch.zeros(4096, dtype=dtype))
        else:
            qw, s = torch.zeros(4096, 4096, dtype=torch.int8), torch.ones(4096, groups)
            yield f"w8a16 {dtype} M={m} groups={groups}", lambda: gemm.w8a16_gemm(x, qw, s)


def _kv_quant_cases(full: bool, paged):
    """The store and both attention kernels over a quantized KV cache (kernels/kv_quant.py's views): each value
    dtype with 16-bit and fp32 models, the split and single decode paths, prefill with and without fresh K/V, a soft
    cap."""
    from kernels import decode_attention as da
    from kernels import kv_quant
    from kernels import prefill_attention as pa
    from kernels import store_kv as sk

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    names = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
    if full:
        cases = [(kv, dt, d, h) for kv in names for dt in (bf16, fp16, fp32) for d in (64, 128) for h in ((32, 8), (16, 1))]
    else:
        cases = [(torch.int8, bf16, 128, (32, 8)), (torch.float8_e4m3fn, bf16, 128, (32, 8)),
                 (torch.float8_e5m2, fp16, 80, (16, 1)), (torch.int8, fp32, 64, (28, 4))]
    for kv_dtype, dtype, head_dim, (q_heads, kv_heads) in cases:
        label = f"{names[kv_dtype]} {dtype} d={head_dim} h={q_heads}/{kv_heads}"
        layer = kv_quant.layer_views(kv_quant.allocate(64, 2, 16, kv_heads, head_dim, kv_dtype, "cpu"), 16, kv_heads,
                                     head_dim)[1]
        q, _, _, bt, sl = paged(dtype, head_dim, q_heads, kv_heads, 2, [700, 1000])
        yield f"decode split {label}", lambda: da._paged_decode_attention(
            q, layer.key, layer.value, bt, sl, 0.1, None, partition_size=512, **layer.scales)
        yield f"decode single {label}", lambda: da._paged_decode_attention(
            q, layer.key, layer.value, bt, sl, 0.1, 64, partition_size=1024, **layer.scales)
        q, _, _, bt, sl = paged(dtype, head_dim, q_heads, kv_heads, 300, [100, 200])
        cu = torch.tensor([0, 100, 300], dtype=torch.int32)
        yield f"prefill {label}", lambda: pa.prefill_attention(q, layer.key, layer.value, bt, cu, sl, 0.1, 128,
                                                               **layer.scales)
        new = torch.zeros(300, kv_heads, head_dim, dtype=dtype)  # a prompt chunk's fresh K/V (what the engine runs)
        yield f"prefill fresh {label}", lambda: pa.prefill_attention(
            q, layer.key, layer.value, bt, cu, sl, 0.1, 128, **layer.scales, fresh_key=new, fresh_value=new,
            fresh_seqs=torch.ones(2, dtype=torch.int32))
        k = torch.zeros(5, kv_heads, head_dim, dtype=dtype)
        yield f"store_kv {label}", lambda: sk.store_kv(k, k, layer.key, layer.value, torch.arange(5), **layer.scales)
    q, _, _, bt, sl = paged(bf16, 128, 16, 8, 2, [700, 1000])
    layer = kv_quant.layer_views(kv_quant.allocate(64, 2, 16, 8, 128, torch.int8, "cpu"), 16, 8, 128)[1]
    yield "decode softcap int8 bf16", lambda: da._paged_decode_attention(
        q, layer.key, layer.value, bt, sl, 0.1, None, partition_size=512, softcap=50.0, **layer.scales)


def _quant_cases(full: bool):
    """kernels/quant_gemm.py at each config branch (M = 1 with split-K, 16, 64, 200) for the bit widths and affine
    maps (offset, min, two-level k-quant scales, zeros with act order), and kernels/quant_rows.py."""
    from kernels import quant_gemm as qg
    from kernels import quant_rows as qr
    from kernels.quant import GGUF_BLOCKS, QuantWeight
    from kernels.quant_gpu import pack_gpu, pack_groups

    def packed(fmt, n=4096, k=4096):
        f = GGUF_BLOCKS[fmt]
        return pack_gpu(QuantWeight(fmt, n, k, torch.zeros(n, k // f.block_size * f.block_bytes, dtype=torch.uint8)))

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    g4 = pack_groups(4, 128, torch.zeros(4096, 4096, dtype=torch.uint8), torch.ones(4096, 32, dtype=fp16),
                     torch.zeros(4096, 32, dtype=torch.int16), torch.arange(4096))
    weights = {f: packed(f) for f in GGUF_BLOCKS} | {"G4 act-order": g4}
    if full:
        cases = [(f, dt, m) for f in weights for dt in (bf16, fp16, fp32) for m in (1, 16, 64, 200)]
    else:
        cases = [("Q4_0", bf16, 1), ("Q4_0", bf16, 16), ("Q4_0", bf16, 64), ("Q4_0", bf16, 200), ("Q8_0", bf16, 1),
                 ("Q8_0", fp16, 64), ("Q4_1", fp16, 16), ("Q5_0", bf16, 1), ("Q4_K", bf16, 1), ("Q4_K", bf16, 64),
                 ("Q5_K", bf16, 16), ("Q6_K", bf16, 1), ("Q6_K", fp16, 200), ("G4 act-order", bf16, 16),
                 ("Q4_1", fp32, 1)]
    for fmt, dtype, m in cases:
        x, w = torch.zeros(m, 4096, dtype=dtype), weights[fmt]
        yield f"quant_gemm {fmt} {dtype} M={m}", lambda: qg.quant_gemm(x, w, torch.zeros(4096, dtype=dtype))
    for fmt in (("Q4_K", "Q6_K", "Q5_1", "Q8_0", "G4 act-order") if not full else weights):
        yield f"quant_rows {fmt} bf16", lambda: qr.quant_rows(weights[fmt], torch.zeros(8, dtype=torch.int64), bf16)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET: this compiles the GPU path", file=sys.stderr)
        return 2
    from kernels import _triton_utils as tu

    tu.triton_available = lambda device: True  # CPU tensors stand in for CUDA ones; nothing is launched
    triton.runtime.driver.set_active(_CompileOnlyDriver())
    triton.knobs.runtime.jit_post_compile_hook = _count_divisions
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""  # a label substring (development)
    failed = 0
    for label, thunk in _cases(full="--all" in sys.argv):
        if only not in label:
            continue
        start, t0 = len(RESULTS), time.perf_counter()
        try:
            thunk()
        except Exception as exc:  # report every failing config, not just the first
            failed += 1
            print(json.dumps({"case": label, "error": f"{type(exc).__name__}: {exc}"[:2000]}))
            continue
        for row in RESULTS[start:]:
            # fp32 is the correctness path (3xTF32 dots spill a little in prefill); fp16/bf16 must not spill
            bad = row["spill_stores"] > 0 and "float32" not in label
            failed += bad
            print(json.dumps({"case": label, **row, **({"spills": True} if bad else {}),
                              "compile_s": round(time.perf_counter() - t0, 2)}))
    print(json.dumps({"compiled": len(RESULTS), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
