"""Triton kernels and their torch references.

Each module holds private ``@triton.jit`` kernel(s), one public launcher that checks shapes/strides and
allocates outputs, and a torch reference ``<name>_ref`` with the same signature. This package knows
nothing of requests: it sees tensors, block tables and lengths.

KV cache layout (DESIGN.md contract): one tensor per engine,
``kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``. A layer's keys are the
strided view ``kv_cache[:, layer, 0]`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``;
kernels take such views and read them through their strides (only the last dim must be contiguous).
A slot is ``block_id * block_size + offset``. A quantized cache (int8, fp8) is
``kv_cache[num_blocks, num_layers, 2, page]``, each page the values then their fp32 scales; kernels then take
value and scale views and ``key_scales`` / ``value_scales`` arguments (kv_quant.py).

Where Triton runs: ``_triton_utils.triton_available(device)`` is True on CUDA, and on CPU when the kernels
were built in interpreter mode: TRITON_INTERPRET=1 must be in the environment *before* the first import of a
kernel module (Triton 3.9 picks interpreted or compiled functions when ``@triton.jit`` runs). Launchers raise
a ValueError naming the argument otherwise. ``_paged_kv`` holds both attention kernels' online-softmax steps over
one K/V tile (a quantized cache's scales applied there); prefill attention's tile configs live in ``prefill_tiles``.

Pieces:
- decode_attention.py   paged_decode_attention: one query token per sequence (flash-decoding on GPU)
- prefill_attention.py  prefill_attention: variable-length causal attention over the paged cache
- prefill_tiles.py      the prefill kernel's tile configs, chosen among by the autotuner on CUDA
- _paged_kv.py          decode's and prefill's steps over one tile of paged K/V (online softmax, quantized K/V scales)
- store_kv.py           store_kv: new K/V rows into their slots of the paged cache (quantized: the reference's bytes)
- kv_quant.py           the quantized KV cache (int8 / fp8 values + fp32 scales per token and head): views, references
- fused.py              fused per-token ops: RMSNorm (+ residual add), in-place RoPE, SwiGLU
- fused_moe.py          fused_moe: every token through its top-k experts
- gemm.py               gemm: y = x @ weight.T (+ bias), bf16 and int8 weight-only
- lora.py               lora_add: LoRA adapters' deltas added per token by slot (shrink / expand, SGMV), its reference
- _triton_utils.py      launcher plumbing: can Triton run here, argument checks that name the argument
- cpu_native.py         the CPU path's kernels in C, loaded with ctypes
- cpu_build.py          building and loading those C kernels (kernels/cpu/*.c)
- cpu_kv_int8.py        the CPU path's store and attention kernels for an int8 KV cache (kernels/cpu/attention_kv8.c)
- cpu_graph.py          a step's C kernel calls recorded once and replayed (engine/decode_graphs.py)
- cpu_lora.py           the CPU path's LoRA shrink / expand in C (kernels/cpu/lora.c), kernels/lora.py's signature
- quant.py              QuantWeight (GGUF block formats as stored) and its torch references
- cpu_quant.py          GGUF-quantized linears and embeddings kept packed, C kernels (kernels/cpu/quant*.c)
- cpu_quant_k.py        the k-quants' (Q4_K, Q5_K, Q6_K) 8-row layout and C calls (kernels/cpu/quant_k*.c)
- cpu_quant_isa.py      the quantized kernels' library and instruction set (scalar, avx2, avx512, vnni; DUET_QUANT_ISA)
- quant_group.py        GroupQuantWeight (GPTQ / AWQ / compressed-tensors: q, group scales and zeros) and its references
- cpu_quant_group.py    group-quantized linears kept packed, C kernels (kernels/cpu/quant_g.c)
- quant_gpu.py          GpuQuant: the Triton kernels' packed layout of every quantized format (GGUF blocks, groups)
- quant_gemm.py         quant_gemm: y = x @ W.T, W packed, dequantized in registers (W4A16 / W8A16; split-K)
- fp8_gemm.py           FP8 checkpoints' W8A8 linears (torch._scaled_mm; per-token / group / static activation scales)
- quant_rows.py         quant_rows: rows of a packed weight gathered and dequantized (token table, large-M fallback)
- _quant_values.py      the two quantized kernels' shared steps: high bits, a group's scale / min / zero
"""
