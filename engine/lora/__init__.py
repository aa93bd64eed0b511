"""lora: LoRA adapters on one base model (issue 50). A PEFT adapter directory is read once into the base model's
fused projections' terms; a fixed pool of slots holds the adapters a batch may use; each linear adds
``scaling * (x @ A^T) @ B^T`` per token for the token's slot (-1: the base alone), its base GEMM untouched.

Pieces:
- ops.py       LoraBatch (a step's slots: the kernels' tensor, or the torch forms' groups), the torch forms, lora_dtype
- manager.py   LoraManager: loaded adapters (host memory, max_cpu_loras), device slots, pins; the scheduler's gate
- slots.py     LoraSlots: which adapter holds which slot; held by running requests, LRU eviction, pinning
- pool.py      LoraPool: the slots' weights per linear (``Linear.lora``), written from a LoraAdapter
- adapter.py   read a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) → LoraAdapter;
               everything duet does not implement refused by name
"""
