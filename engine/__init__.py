"""engine: one process, one model, one paged KV cache — no Ray, no network. A step is schedule → run → sample →
update (engine.py). By concept, one folder per noun; a floor imports only the floors below it (docs/ARCHITECTURE.md).

Pieces (each module's docstring is its design note):
- async_engine.py    AsyncEngine: the engine loop on its own thread, streaming outputs to asyncio callers
- engine.py          Engine: one step = schedule → run → sample → update
- engine_emit.py     a step's logits → outputs (a mixin of Engine)
- engine_handoff.py  hand off, reserve, commit or fail remote KV (a mixin of Engine)
- model_runner.py    ModelRunner: the model and the KV cache tensor; one SchedulerOutput → one forward pass
- decode_graphs.py   decode steps replayed: CUDA graphs, or on a CPU recordings of the C kernel calls
- config.py          the engine's config tree: EngineConfig and SpeculativeConfig
- request.py         Request: the one object that carries a sequence through the engine
- outputs.py         RequestOutput / CompletionOutput: what the engine streams per request per step
- errors.py          the errors the engine raises on purpose
- histogram.py       Histogram: latencies kept where they are measured, exported by the router's /metrics
- text/              tokenizer, chat templates, stop conditions (torch-free; the router imports them)
- hub/               models named by Hugging Face Hub id: resolved to one commit, fetched into the HF cache
- loading/           checkpoints: HF directories and GGUF files → ModelConfig, Tokenizer, weights; tiny test models
- models/            ModelConfig and the torch models: Llama family, attention, MoE, kernels, tensor parallel
- kv/                KV bookkeeping: hashing, block pool, events, tiers, sizing, handoff (torch-free but mover.py)
- sched/             the scheduler and the SchedulerOutput contract it hands the model runner (torch-free)
- sampling/          the sampler and structured output (grammars)
- speculative/       speculative decoding: proposers, draft model, verification, policy, decoder
- lora/              LoRA adapters: PEFT directories read, a slot pool, the per-token shrink / expand
"""
