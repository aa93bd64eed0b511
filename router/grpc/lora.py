"""gRPC's runtime LoRA RPCs (proto/duet/v1/generate.proto ``LoadLoraAdapter`` / ``UnloadLoraAdapter``), the same
verbs as HTTP's vLLM endpoints (router/http/lora_admin.py) over the backend's ``lora`` (router/lora_adapters.py).

They are the operator's writes, so the admin-key rule applies (router/access.py), not the API-key interceptor's:
``ApiKeyInterceptor`` lets ``ADMIN_METHODS`` through and ``LoraAdminRpcs`` checks the caller itself (none or a bad
credential: UNAUTHENTICATED; a key that may not write, or no admin key on a non-loopback bind: PERMISSION_DENIED).
Status codes: INVALID_ARGUMENT for what the caller got wrong (a name or path missing, a name already served, an
adapter duet cannot serve, a limit), NOT_FOUND for an unknown name (unload) or no directory at the path (load),
UNAVAILABLE when a worker failed (the load was undone on the others), FAILED_PRECONDITION when this server cannot
change its adapters at all. A mixin of ``GenerateServicer`` (router/grpc/server.py): it uses the servicer's
``backend``, ``admin_key``, ``api_keys`` and ``bind_host``.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from engine.errors import DuetError, LoraAdapterNotFoundError
from proto.duet.v1 import generate_pb2 as pb
from router.access import write_denied
from router.tenancy import metadata_bearer

if TYPE_CHECKING:
    from router.grpc.server import GenerateServicer

log = logging.getLogger(__name__)

ADMIN_METHODS = ("LoadLoraAdapter", "UnloadLoraAdapter")


class LoraAdminRpcs:
    async def LoadLoraAdapter(self: GenerateServicer, request: pb.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> pb.LoraAdapterResponse:
        adapters = await self._writable_lora(context)
        if not request.lora_name or not request.lora_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "both lora_name and lora_path must be provided")
        await _run(context, adapters.load(request.lora_name, request.lora_path, request.pinned))
        return pb.LoraAdapterResponse(message=f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    async def UnloadLoraAdapter(self: GenerateServicer, request: pb.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> pb.LoraAdapterResponse:
        adapters = await self._writable_lora(context)
        if not request.lora_name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name must be provided")
        await _run(context, adapters.unload(request.lora_name))
        return pb.LoraAdapterResponse(message=f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    async def _writable_lora(self: GenerateServicer, context: grpc.aio.ServicerContext):
        token = metadata_bearer(context.invocation_metadata() or ())
        denied = write_denied(token, self.api_keys, self.admin_key, self.bind_host)
        if denied is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED if denied.unauthenticated
                                else grpc.StatusCode.PERMISSION_DENIED, denied.message)
        if self.backend.lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this server cannot load or unload LoRA adapters at run time")
        return self.backend.lora


async def _run(context: grpc.aio.ServicerContext, call) -> None:
    try:
        await call
    except LoraAdapterNotFoundError as e:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
    except DuetError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except grpc.aio.AbortError:
        raise
    except Exception as e:  # a worker failed: router/lora_adapters.py undid the load on the others
        log.error("LoRA adapter change failed: %s", e)
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
