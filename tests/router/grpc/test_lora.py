"""LoRA adapters through the gRPC front door: ListModels lists them after the base; a request naming one in
``model`` reaches the backend with ``SamplingParams.lora`` set; the base name or none runs the base. LoadLoraAdapter /
UnloadLoraAdapter follow the admin-key rule (router/access.py) and answer vLLM's messages, INVALID_ARGUMENT /
NOT_FOUND for bad input."""
from __future__ import annotations

import grpc
import pytest

from engine.errors import LoraAdapterError, LoraAdapterNotFoundError
from engine.outputs import RequestOutput
from router.backend import Backend, Health, ModelCard
from router.grpc.server import pb, pb_grpc, start_grpc_server  # the generated modules, built there when missing
from router.lora_adapters import LoraAdapters, ServedAdapter

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


class FakeWorker:
    """A worker's LoRA verbs in memory (router/lora_adapters.py's target): a path "missing/..." is not there, a path
    "bad/..." is an adapter duet cannot serve; the digest is the path's."""

    worker_id = "w0"

    def __init__(self) -> None:
        self.held: dict[str, str] = {}

    async def load_lora(self, name, path, pinned=False):
        if path.startswith("missing/"):
            raise LoraAdapterNotFoundError(f"no LoRA adapter directory at {path}")
        if path.startswith("bad/"):
            raise LoraAdapterError(f"{path}/adapter_config.json: use_dora=True is not supported by duet's LoRA")
        self.held[name] = "digest-" + path
        return self.held[name]

    async def unload_lora(self, name):
        if self.held.pop(name, None) is None:
            raise LoraAdapterNotFoundError(f"LoRA adapter {name!r} is not loaded")

    async def lora_adapters(self):
        return dict(self.held)


async def _call(stub, method, request, key=None):
    try:
        reply = await getattr(stub, method)(request, metadata=(("authorization", f"Bearer {key}"),) if key else ())
        return "OK", reply.message
    except grpc.aio.AioRpcError as e:
        return e.code().name, e.details()


@pytest.mark.parametrize("api_keys", [(), ("user-key",)])
async def test_load_and_unload_over_grpc_need_the_admin_key(api_keys):
    backend, worker = RecordingBackend(), FakeWorker()
    backend.lora = LoraAdapters(lambda: [worker], [ServedAdapter("ad1", "p/ad1"), ServedAdapter("ad2", "p/ad2")])
    server = await start_grpc_server(backend, "127.0.0.1", 0, api_keys=api_keys, admin_key="adm")
    load = lambda name, path, key="adm": _call(stub, "LoadLoraAdapter",  # noqa: E731
                                               pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path), key)
    unload = lambda name, key="adm": _call(stub, "UnloadLoraAdapter",  # noqa: E731
                                           pb.UnloadLoraAdapterRequest(lora_name=name), key)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.GenerateStub(ch)
            assert (await load("x", "p/x", None))[0] == "UNAUTHENTICATED"
            assert (await load("x", "p/x", "user-key"))[0] == "PERMISSION_DENIED"
            assert await load("x", "") == ("INVALID_ARGUMENT", "both lora_name and lora_path must be provided")
            assert (await load("x", "missing/x"))[0] == "NOT_FOUND"
            code, message = await load("x", "bad/x")
            assert code == "INVALID_ARGUMENT" and message.startswith("worker w0: bad/x/adapter_config.json: use_dora")
            assert await load("ad3", "p/ad3") == ("OK", "Success: LoRA adapter 'ad3' added successfully.")
            assert (await load("ad3", "p/ad3"))[0] == "INVALID_ARGUMENT"  # already loaded
            reader = (("authorization", f"Bearer {api_keys[0]}"),) if api_keys else ()  # reads: the API key
            models = await stub.ListModels(pb.ListModelsRequest(), metadata=reader)
            assert [(m.id, m.parent) for m in models.models] == [("base", ""), ("ad1", "base"), ("ad2", "base"),
                                                                 ("ad3", "base")]
            assert worker.held == {"ad3": "digest-p/ad3"}
            assert await unload("ad1") == ("OK", "Success: LoRA adapter 'ad1' removed successfully.")
            assert (await unload("ad1"))[0] == "NOT_FOUND"
            assert backend.lora.names() == ("ad2", "ad3")
    finally:
        await server.stop(None)


async def test_lora_rpcs_on_a_server_without_admin_key():
    """No admin key: writes only on a loopback bind (then under the API-key rule); elsewhere PERMISSION_DENIED."""
    backend = RecordingBackend()
    backend.lora = LoraAdapters(lambda: [FakeWorker()])
    for host, want in (("127.0.0.1", "OK"), ("0.0.0.0", "PERMISSION_DENIED")):
        server = await start_grpc_server(backend, host, 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                code, _ = await _call(pb_grpc.GenerateStub(ch), "LoadLoraAdapter",
                                      pb.LoadLoraAdapterRequest(lora_name=f"n-{host}", lora_path="p/n"))
                assert code == want, host
        finally:
            await server.stop(None)
