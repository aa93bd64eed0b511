"""LocalBackend: the front-door `Backend` over one in-process engine (no Ray, no disaggregation).

Used by the front-door tests and by `duet serve --colocated`. The engine runs on its own thread
(`AsyncEngine`); closing a stream aborts the request there, which frees its blocks. LoRA adapters load and unload at
run time as on a cluster (router/lora_adapters.py), the engine its one target.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.request import SamplingParams
from router.backend import Backend, Health, ModelCard
from router.lora_adapters import LoraAdapters, ServedAdapter
from router.lora_resolver import LoraResolver


class LocalBackend(Backend):
    def __init__(self, engine: Engine, model_id: str | None = None, lora_resolver: LoraResolver | None = None) -> None:
        self.engine = engine
        engine.capture_decode_graphs()  # a colocated engine decodes: every bucket before serving (CUDA only)
        self.async_engine = AsyncEngine(engine)
        self.tokenizer = engine.tokenizer
        self.card = ModelCard(model_id=model_id or str(engine.config.model), max_model_len=engine.max_model_len,
                              vocab_size=engine.model_config.vocab_size, created=int(time.time()),
                              longrope_original_len=engine.model_config.longrope_original_len,
                              weights=engine.runner.weights,
                              lora_adapters=tuple(engine.runner.lora.names()) if engine.runner.lora else ())
        pinned = set(engine.config.pinned_loras or ())
        self.lora = LoraAdapters(lambda: [_EngineTarget(self.async_engine)], [
            ServedAdapter(name, path, name in pinned, engine.runner.lora.digest(name))
            for name, path in engine.config.lora_modules or ()], lora_resolver)

    @classmethod
    def from_config(cls, config: EngineConfig, model_id: str | None = None,
                    lora_resolver: LoraResolver | None = None) -> LocalBackend:
        return cls(Engine(config), model_id, lora_resolver)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.check_request(prompt_token_ids, params)
        await self.lora.admit(params.lora)
        try:
            async for out in self.async_engine.generate(prompt_token_ids=list(prompt_token_ids), params=params,
                                                        request_id=request_id):
                yield out
        finally:
            self.lora.end(params.lora)

    def health(self) -> Health:
        alive = self.async_engine._thread.is_alive()
        return Health(ok=alive, detail={"engine": "alive" if alive else "dead",
                                        "running": len(self.engine.scheduler.running)})

    async def aclose(self) -> None:
        self.async_engine.shutdown()



class _EngineTarget:
    """The in-process engine as router/lora_adapters.py's target (a worker's LoRA verbs, without Ray)."""

    worker_id = "local"

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.load_lora = async_engine.load_lora
        self.unload_lora = async_engine.unload_lora
        self.lora_adapters = async_engine.lora_adapters
