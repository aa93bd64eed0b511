"""engine.models: what a model is (ModelConfig) and the torch code that runs it over the paged KV cache.

Pieces (each module's docstring is its design note):
- config.py           ModelConfig: what the checkpoint says, read from config.json (its rules in the docstring)
- config_gemma.py     Gemma 2 / 3 fields of a config.json (ModelConfig.gemma)
- config_moe.py       mixture-of-experts fields of a config.json (ModelConfig.moe)
- config_quant.py     a config.json's quantization_config: GPTQ / AWQ / compressed-tensors read, the rest refused
- config_fp8.py       the FP8 methods' configs (compressed-tensors float-quantized, fp8 block, fbgemm_fp8)
- config_rope.py      RoPE fields of a config.json, every transformers spelling, into one (type, theta, parameters)
- llama.py            CausalLM: the Llama family (Qwen2/3, Mistral, Phi-3, Gemma, MoE) as one readable torch model
- layers.py           building blocks matching Hugging Face's arithmetic: RMSNorm, RoPE, SwiGLU
- attention.py        attention over the paged KV cache for one mixed batch
- moe.py              mixture-of-experts layers
- kernel_backend.py   the kernel backend seam: which implementation of each op the model calls
- tensor_parallel.py  tensor parallelism inside one engine: the split over ranks and its collectives
"""
