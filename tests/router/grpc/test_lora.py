"""LoRA adapters through the gRPC front door: ListModels lists them after the base; a request naming one in
``model`` reaches the backend with ``SamplingParams.lora`` set; the base name or none runs the base."""
from __future__ import annotations

import grpc
import pytest

from engine.outputs import RequestOutput
from router.backend import Backend, Health, ModelCard
from router.grpc.server import pb, pb_grpc, start_grpc_server  # the generated modules, built there when missing

pytestmark = pytest.mark.asyncio(loop_scope="module")


class RecordingBackend(Backend):
    def __init__(self) -> None:
        self.card = ModelCard(model_id="base", max_model_len=64, vocab_size=100, lora_adapters=("ad1", "ad2"))
        self.tokenizer = None
        self.seen: list[str | None] = []

    async def generate(self, request_id, prompt_token_ids, params):
        self.seen.append(params.lora)
        yield RequestOutput(request_id=request_id, new_token_ids=[7], new_text="", finished=True,
                            finish_reason="length")

    def health(self) -> Health:
        return Health(ok=True)


async def test_model_names_the_adapter():
    backend = RecordingBackend()
    server = await start_grpc_server(backend, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.GenerateStub(ch)
            models = await stub.ListModels(pb.ListModelsRequest())
            assert [m.id for m in models.models] == ["base", "ad1", "ad2"]
            for model in ("ad2", "base", "", "ad1"):
                [_ async for _ in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), model=model,
                                                                   max_tokens=1))]
            assert backend.seen == ["ad2", None, None, "ad1"]
            with pytest.raises(grpc.aio.AioRpcError, match="unknown model 'ad3'"):
                [_ async for _ in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), model="ad3"))]
    finally:
        await server.stop(None)
