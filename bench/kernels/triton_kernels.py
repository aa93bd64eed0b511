"""make bench-kernels: duet's Triton kernels against the hardware's limits and torch's own kernels.

On a CUDA GPU (bf16, Llama-3-8B-like heads: 32 query / 8 KV heads of 128, block size 16):
- decode attention, batch 64 x 4096-token context: achieved GB/s of K/V read, as a fraction of the device's
  HBM peak (table below; decode is bound by reading the cache, so this is the number that matters); then the same
  K/V quantized (int8, fp8_e4m3: 1-byte values + an fp32 scale per token and KV head, kernels/kv_quant.py) by the
  Triton store: GB/s of values and scales read, and the step time against the bf16 cache's;
- prefill attention, 4 prompts of 2048 tokens from the paged cache: TFLOP/s (causal FLOPs) vs torch SDPA on
  contiguous, unpaged tensors (its flash backend), ``prefill attention ratio: triton / sdpa``;
- GEMM at prefill (M = 4096) and decode (M = 1, 16, 64) shapes: TFLOP/s vs torch.matmul (cuBLAS);
- w8a16 int8 weight-only GEMM vs the bf16 GEMM at decode shapes (weight bytes halve: up to 2x).
Each kernel's output is first checked against its reference. The last line is ``ratio: <x>``, the geometric
mean over the GEMM shapes of triton / torch.matmul throughput.

``--prefill`` runs only the prefill attention study (issue 51): bf16, 32 / 8 heads of 128, 4 x 2,048 and
1 x 16,384 causal prompts and 4 x (1,024 cached + 1,024 new) tokens, each from a paged cache of block size 16
(tiles gathered across blocks) and 128 (a tile inside one block): the autotuned kernel's TFLOP/s, its
output checked against SDPA's on the same K/V, every tile config's TFLOP/s, SDPA on contiguous
[batch, heads, tokens, head_dim] tensors (bottom-right causal when queries are fewer than keys, as
FlashAttention defines it) in each form (is_causal / the lower-right mask, GQA / heads expanded) on each
backend (flash forced, cuDNN forced, torch's default: cuDNN on an H200), and a ``ratio:`` line per case
against the fastest flash form (the issue's baseline);
Both count the FLOPs of the (query, key) pairs the causal mask lets through.

With ``--small``, or without CUDA, every kernel runs once at a tiny size in the Triton interpreter on CPU and
the same lines are printed (timings there mean nothing; the point is that this script cannot rot).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import sys
import time

# must precede the first import of kernels/ (see kernels/_triton_utils.py); decided in main() before that
_SMALL = "--small" in sys.argv[1:]
_HAS_CUDA = False
if not _SMALL:
    import torch as _torch

    _HAS_CUDA = _torch.cuda.is_available()
if _SMALL or not _HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kernels import kv_quant  # noqa: E402
from kernels import prefill_attention as pa  # noqa: E402
from kernels import prefill_tiles as tiles  # noqa: E402
from kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from kernels.gemm import gemm, quantize_weight_int8, w8a16_gemm, w8a16_gemm_ref  # noqa: E402
from kernels.prefill_attention import prefill_attention, prefill_attention_ref  # noqa: E402
from kernels.store_kv import store_kv, store_kv_ref  # noqa: E402

# HBM peak in TB/s by device name (first match wins: most specific names first)
HBM_PEAK_TBPS = [
    ("GH200", 4.0), ("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("H800", 3.35),
    ("B200", 8.0), ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935), ("A100", 1.555), ("L40S", 0.864),
    ("L40", 0.864), ("L4", 0.3), ("A10G", 0.6), ("A10", 0.6), ("RTX 4090", 1.008), ("RTX 3090", 0.936),
]


class Setup:
    """Sizes and timing for one mode: the GPU benchmark or the tiny interpreter run."""

    def __init__(self, small: bool):
        self.small = small
        self.device = torch.device("cpu" if small else "cuda")
        self.dtype = torch.float16 if small else torch.bfloat16
        self.q_heads, self.kv_heads, self.head_dim, self.block_size = (4, 2, 64, 16) if small else (32, 8, 128, 16)

    def time_ms(self, fn, graph: bool = False) -> float:
        """Median ms; ``graph``: replayed from a CUDA graph, as the engine runs decode steps — at decode shapes a
        Triton launch from Python costs more than the kernel (measured on an H200: our M=1 GEMM timed 160 us
        launched, ~12 us replayed; bench/kernels/gemm_sweep.py)."""
        if self.small:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton.testing

        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def randn(self, *shape, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=self.device) * scale).to(self.dtype)


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Max error relative to the reference's largest magnitude (outputs of long-context attention are small)."""
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()
    status = "ok" if err <= tol else "MISMATCH"
    print(f"  check {name}: max err {err:.2e} of max |ref| (tol {tol:.0e}) {status}")
    if status != "ok":
        raise SystemExit(f"{name} disagrees with its reference")


def paged_inputs(s: Setup, seq_lens: list[int], q_tokens: int):
    blocks_per_seq = max(seq_lens) // s.block_size + 1
    num_blocks = len(seq_lens) * blocks_per_seq
    kv = s.randn(num_blocks, 2, 2, s.block_size, s.kv_heads, s.head_dim)  # [blocks, layers, K/V, B, h, d]
    tables = torch.randperm(num_blocks, device=s.device).view(len(seq_lens), blocks_per_seq).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=s.device)
    q = s.randn(q_tokens, s.q_heads, s.head_dim)
    return q, kv[:, 1, 0], kv[:, 1, 1], tables, lens


def bench_store_kv(s: Setup) -> None:
    q, kc, vc, _, _ = paged_inputs(s, [64], 1)
    k, v = s.randn(32, s.kv_heads, s.head_dim), s.randn(32, s.kv_heads, s.head_dim)
    slots = torch.randperm(kc.shape[0] * s.block_size, device=s.device)[:32]
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, slots)
    store_kv_ref(k, v, kc2, vc2, slots)
    check("store_kv", kc, kc2, 0.0)


def bench_decode(s: Setup) -> None:
    batch, context = (4, 100) if s.small else (64, 4096)
    q, kc, vc, tables, lens = paged_inputs(s, [context] * batch, batch)
    scale = s.head_dim ** -0.5
    n = min(batch, 4)
    check("decode", paged_decode_attention(q[:n], kc, vc, tables[:n], lens[:n], scale),
          paged_decode_attention_ref(q[:n], kc, vc, tables[:n], lens[:n], scale), 2e-2)
    ms = s.time_ms(lambda: paged_decode_attention(q, kc, vc, tables, lens, scale))
    kv_bytes = 2 * batch * context * s.kv_heads * s.head_dim * kc.element_size()
    print(f"decode attention  batch {batch} x {context} ctx, {s.q_heads}/{s.kv_heads} heads x {s.head_dim}: "
          f"{ms:.3f} ms, {_bandwidth(s, kv_bytes, ms)}")
    rows = (kc.shape[0] * s.block_size, s.kv_heads, s.head_dim)
    for kv_name, kv_dtype in (("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
        layer = kv_quant.layer_views(kv_quant.allocate(kc.shape[0], 1, s.block_size, s.kv_heads, s.head_dim, kv_dtype,
                                                       s.device), s.block_size, s.kv_heads, s.head_dim)[0]
        store_kv(kc.reshape(rows), vc.reshape(rows), layer.key, layer.value, torch.arange(rows[0], device=s.device),
                 **layer.scales)
        check(f"decode {kv_name} KV", paged_decode_attention(q[:n], layer.key, layer.value, tables[:n], lens[:n], scale,
                                                             **layer.scales),
              paged_decode_attention_ref(q[:n], layer.key, layer.value, tables[:n], lens[:n], scale, **layer.scales),
              2e-2)
        ms_q = s.time_ms(lambda: paged_decode_attention(q, layer.key, layer.value, tables, lens, scale, **layer.scales))
        q_bytes = 2 * batch * context * s.kv_heads * (s.head_dim + 4)  # values + fp32 scales
        print(f"decode attention  {kv_name} KV, same shapes: {ms_q:.3f} ms ({ms / ms_q:.2f}x the {s.dtype} cache's "
              f"speed), {_bandwidth(s, q_bytes, ms_q)}")


def _bandwidth(s: Setup, num_bytes: int, ms: float) -> str:
    gbps = num_bytes / ms / 1e6
    name = "cpu (interpreter)" if s.small else torch.cuda.get_device_name()
    peak = None if s.small else next((tb for key, tb in HBM_PEAK_TBPS if key in name), None)
    frac = f"{gbps / (peak * 1e3):.1%} of {peak} TB/s HBM peak" if peak else "HBM peak unknown for this device"
    return f"{gbps:.1f} GB/s = {frac} [{name}]"


def bench_prefill(s: Setup) -> None:
    batch, length = (2, 40) if s.small else (4, 2048)
    q, kc, vc, tables, lens = paged_inputs(s, [length] * batch, batch * length)
    cu = torch.arange(0, batch + 1, device=s.device, dtype=torch.int32) * length
    scale = s.head_dim ** -0.5
    n = 1 if not s.small else batch  # check one sequence: the reference loops in Python
    check("prefill", prefill_attention(q[: n * length], kc, vc, tables[:n], cu[: n + 1], lens[:n], scale),
          prefill_attention_ref(q[: n * length], kc, vc, tables[:n], cu[: n + 1], lens[:n], scale), 2e-2)
    ms = s.time_ms(lambda: prefill_attention(q, kc, vc, tables, cu, lens, scale))
    # SDPA baseline on contiguous [batch, heads, tokens, d] tensors, GQA expanded by SDPA itself
    qs = q.view(batch, length, s.q_heads, s.head_dim).transpose(1, 2)
    ks = s.randn(batch, s.kv_heads, length, s.head_dim)
    vs = s.randn(batch, s.kv_heads, length, s.head_dim)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms_ref = s.time_ms(lambda: sdpa(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True))
    flops = 4 * batch * length * length / 2 * s.q_heads * s.head_dim  # QK^T and PV, causal half
    print(f"prefill attention {batch} x {length} tokens: triton {flops / ms / 1e9:.1f} TFLOP/s, "
          f"sdpa {flops / ms_ref / 1e9:.1f} TFLOP/s")
    print(f"prefill attention ratio: {ms_ref / ms:.3f} (triton / torch SDPA)")


def _sdpa_flash(s: Setup):
    """SDPA forced onto its flash backend on CUDA (an error rather than a silent fallback), with FlashAttention's
    bottom-right causal mask (``causal_lower_right``: the same as is_causal when queries and keys match)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run(q, k, v, scale):  # [B, Hq, Lq, D], [B, Hkv, Lk, D]
        mask = causal_lower_right(q.shape[2], k.shape[2])
        if s.small:
            return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            try:
                return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            except RuntimeError as exc:  # a torch whose flash path takes no GQA here: the same FLOPs, heads expanded
                if not expanded:
                    print(f"  sdpa flash: no GQA with the lower-right mask ({str(exc)[:120]}): K/V heads expanded")
                    expanded.append(True)
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                return sdpa(q, k, v, attn_mask=mask, scale=scale)
    expanded: list[bool] = []
    return run


def _sdpa_fastest_ms(s: Setup, qs, ks, vs, scale: float) -> tuple[float, str]:
    """The baseline: the fastest of SDPA's ways to compute the same causal attention on contiguous tensors (the
    flash backend forced): ``is_causal`` (only when queries and keys match: torch aligns it top-left), the
    lower-right mask, and both on K/V heads expanded before timing. (ms, which) — each variant printed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    sdpa = torch.nn.functional.scaled_dot_product_attention
    group = qs.shape[1] // ks.shape[1]
    ke, ve = ks.repeat_interleave(group, dim=1).contiguous(), vs.repeat_interleave(group, dim=1).contiguous()
    mask = causal_lower_right(qs.shape[2], ks.shape[2])
    variants = {"lower-right mask, gqa": lambda: sdpa(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True),
                "lower-right mask, heads expanded": lambda: sdpa(qs, ke, ve, attn_mask=mask, scale=scale)}
    if qs.shape[2] == ks.shape[2]:
        variants["is_causal, gqa"] = lambda: sdpa(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        variants["is_causal, heads expanded"] = lambda: sdpa(qs, ke, ve, is_causal=True, scale=scale)
    best = (float("inf"), "")
    backends = {"flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION], "default": None}
    for (name, fn), (backend, which) in itertools.product(variants.items(), backends.items()):
        if s.small and backend != "flash":
            continue
        try:
            with sdpa_kernel(which) if which and not s.small else contextlib.nullcontext():
                ms = s.time_ms(fn)
        except RuntimeError as exc:
            print(f"  sdpa {backend} {name}: refused ({str(exc)[:100]})")
            continue
        print(f"  sdpa {backend} {name}: {ms:.3f} ms")
        if backend == "flash":  # the baseline the issue names; the others are printed for the record
            best = min(best, (ms, name))
    return best


def bench_prefill_study(s: Setup) -> None:
    cases = ([("2 x 40", 2, 40, 0), ("1 x 96", 1, 96, 0), ("2 x (24 + 24 cached)", 2, 24, 24)] if s.small else
             [("4 x 2048", 4, 2048, 0), ("1 x 16384", 1, 16384, 0), ("4 x (1024 + 1024 cached)", 4, 1024, 1024)])
    block_sizes = (8, 32) if s.small else (16, 128)
    configs = tiles.configs_for(s.dtype, s.head_dim)
    scale = s.head_dim ** -0.5
    sdpa = _sdpa_flash(s)
    for name, batch, new, cached in cases:
        length = new + cached
        pairs = batch * sum(cached + i + 1 for i in range(new))  # (query, key) pairs inside the causal mask
        flops = 4 * pairs * s.q_heads * s.head_dim
        cu = torch.arange(0, batch + 1, device=s.device, dtype=torch.int32) * new
        q = s.randn(batch * new, s.q_heads, s.head_dim)
        qs = q.view(batch, new, s.q_heads, s.head_dim).transpose(1, 2)
        ms_by_block = {}
        for block_size in block_sizes:
            s.block_size = block_size
            _, kc, vc, tables, lens = paged_inputs(s, [length] * batch, 1)
            ks = torch.stack([pa.gather_kv(kc, t, length) for t in tables]).transpose(1, 2).contiguous()
            vs = torch.stack([pa.gather_kv(vc, t, length) for t in tables]).transpose(1, 2).contiguous()
            check(f"prefill {name} block {block_size} vs sdpa", prefill_attention(q, kc, vc, tables, cu, lens, scale),
                  sdpa(qs, ks, vs, scale).transpose(1, 2).reshape_as(q), 2e-2)
            tuned = pa.last_autotuned_config(s.dtype, s.head_dim)
            ms = ms_by_block[block_size] = s.time_ms(lambda: prefill_attention(q, kc, vc, tables, cu, lens, scale))
            line = f"prefill {name} tokens, block {block_size}: triton {flops / ms / 1e9:.1f} TFLOP/s"
            print(f"{line} ({'autotuned: ' + _config_name(tuned) if tuned else 'untuned: ' + _config_name(configs[0])})")
            for config in configs if len(configs) > 1 else ():
                try:  # one config that fails to build on this GPU must not cost the other figures
                    ms_c = s.time_ms(lambda: prefill_attention(q, kc, vc, tables, cu, lens, scale, config=config))
                    print(f"  config {_config_name(config)}: tflops={flops / ms_c / 1e9:.1f}")
                except Exception as exc:  # noqa: BLE001
                    print(f"  config {_config_name(config)}: failed: {type(exc).__name__}: {str(exc)[:200]}")
        ms_ref, how = _sdpa_fastest_ms(s, qs, ks, vs, scale)
        print(f"prefill {name} tokens: sdpa flash {flops / ms_ref / 1e9:.1f} TFLOP/s (contiguous; fastest: {how})")
        for block_size, ms in ms_by_block.items():
            print(f"prefill {name} block {block_size} ratio: {ms_ref / ms:.3f} (triton / sdpa flash)")


def _config_name(c: tiles.TileConfig) -> str:
    return f"BLOCK_M {c.block_m} BLOCK_N {c.block_n} warps {c.num_warps} stages {c.num_stages}"


def bench_gemm(s: Setup) -> float:
    n = k = 64 if s.small else 4096
    ms_list = (1, 16, 40) if s.small else (1, 16, 64, 4096)
    ratios = []
    for m in ms_list:
        x, w = s.randn(m, k), s.randn(n, k, scale=k ** -0.5)
        check(f"gemm M={m}", gemm(x, w), (x.float() @ w.float().T), 5e-2)
        kind = "decode" if m <= 64 else "prefill"
        ms = s.time_ms(lambda: gemm(x, w), graph=kind == "decode")
        ms_ref = s.time_ms(lambda: torch.matmul(x, w.T), graph=kind == "decode")
        flops = 2 * m * n * k
        print(f"gemm {kind:7s} {m}x{n}x{k}: triton {flops / ms / 1e9:.2f} TFLOP/s, "
              f"torch.matmul {flops / ms_ref / 1e9:.2f} TFLOP/s, triton/torch {ms_ref / ms:.3f}")
        ratios.append(ms_ref / ms)
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def bench_w8a16(s: Setup) -> None:
    n = k = 64 if s.small else 4096
    for group_size in (None, 128 if not s.small else 32):
        for m in (1, 16) if s.small else (1, 16, 64):
            x, w = s.randn(m, k), s.randn(n, k, scale=k ** -0.5)
            qweight, scales = quantize_weight_int8(w, group_size)
            check(f"w8a16 M={m}", w8a16_gemm(x, qweight, scales), w8a16_gemm_ref(x, qweight, scales), 5e-2)
            ms_q = s.time_ms(lambda: w8a16_gemm(x, qweight, scales), graph=True)
            ms_bf16 = s.time_ms(lambda: gemm(x, w), graph=True)
            ms_torch = s.time_ms(lambda: torch.matmul(x, w.T), graph=True)
            weights = "per-channel" if group_size is None else f"group {group_size}"
            print(f"w8a16 decode {m}x{n}x{k} ({weights}): {ms_q * 1e3:.1f} us vs {str(s.dtype)[6:]} triton "
                  f"{ms_bf16 * 1e3:.1f} us / torch {ms_torch * 1e3:.1f} us, speedup vs torch {ms_torch / ms_q:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes in the Triton interpreter on CPU")
    parser.add_argument("--prefill", action="store_true", help="only the prefill attention study")
    args = parser.parse_args()
    small = args.small or not torch.cuda.is_available()
    if small and not args.small:
        print("no CUDA device: running --small in the Triton interpreter (timings are not meaningful)")
    torch.manual_seed(0)
    s = Setup(small)
    print(f"mode: {'interpreter on CPU, tiny sizes' if small else torch.cuda.get_device_name()}, dtype {s.dtype}")
    if args.prefill:
        bench_prefill_study(s)
        return
    bench_store_kv(s)
    bench_decode(s)
    bench_prefill(s)
    bench_w8a16(s)
    gemm_ratio = bench_gemm(s)
    print(f"ratio: {gemm_ratio:.3f}")


if __name__ == "__main__":
    main()
