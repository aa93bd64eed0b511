"""bench.kernels: kernels against the hardware's limits.

Pieces (each module's docstring is its design note):
- triton_kernels.py  make bench-kernels: duet's Triton kernels against torch's and the roofline
- gemm_sweep.py      tile configs of the Triton GEMM at decode shapes
- gemm_backends.py   MKL sgemm vs oneDNN on packed weights (the CPU path)
- kv_attention.py    the CPU attention kernels over an fp32 vs an int8 KV cache (decode, store, prefill)
- quant_gemv.py      GGUF-quantized GEMVs (kernels/cpu_quant.py) vs torch's fp32 GEMM on the dequantized weight
- quant_group_gemv.py  group-quantized GEMVs (GPTQ / AWQ / compressed-tensors: kernels/cpu_quant_group.py) vs GGUF's
- quant_gemm.py      W4A16 / W8A16 Triton GEMMs (kernels/quant_gemm.py) vs bf16 cuBLAS, and their crossover M
- fp8_gemm.py        FP8 checkpoints' W8A8 linears (torch._scaled_mm) vs bf16 cuBLAS, Llama-8B shapes (GPU)
- lora_cpu.py        the CPU LoRA kernel between a decode step's oneDNN GEMMs: what 8 adapters add to the step
"""
