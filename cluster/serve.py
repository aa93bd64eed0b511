"""`duet serve`: the cluster and its front doors in one process.

    duet serve --model DIR|FILE.gguf|org/name[@rev][:QUANT] [--prefill N] [--decode M] [--host H] [--port 8000]
               [--grpc-port 50051] [--address RAY] [--config cluster.yaml] [--colocated]

A Hugging Face Hub id is resolved and fetched here, once, and pinned to its commit (engine/hub/resolve.py) before
anything starts. Starts (or attaches to) Ray, places the pools (cluster.launcher), and serves the OpenAI HTTP API
(router.http.app) and the gRPC API (router.grpc.server) on one asyncio loop. `--colocated` skips Ray and
disaggregation: one in-process engine behind the same front doors (the baseline for comparisons).

Shutdown on SIGINT / SIGTERM is graceful: the HTTP server stops accepting and lets in-flight responses
finish (uvicorn's own signal handling, bounded by `GRACE_S`; a second signal exits at once), gRPC is
stopped with the same grace, then the workers are shut down (engine threads joined, NIXL agents
closed) and a Ray this process started is stopped.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

import uvicorn

from cluster.config import ClusterConfig

log = logging.getLogger("duet.serve")

GRACE_S = 10.0


class _Server(uvicorn.Server):
    """uvicorn's server, minus its habit of re-raising the stop signal after a graceful shutdown
    (the process would then die by SIGTERM before our own cleanup ran, and exit non-zero)."""

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests)
                continue
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        if self.should_exit:  # a second signal: stop now
            self.force_exit = True
        self.should_exit = True


async def serve(config: ClusterConfig, *, colocated: bool = False) -> None:
    from router.admission import AdmittedBackend
    from router.grpc.server import start_grpc_server
    from router.http.app import create_app
    from router.metrics.collector import AdmissionCollector

    cluster = None
    config = await asyncio.to_thread(config.with_pinned_model)  # a Hub id: resolved and fetched once, here
    if colocated:
        from cluster.local_backend import LocalBackend
        backend = LocalBackend.from_config(config.engine, model_id=config.model_name,
                                           lora_resolver=config.router.lora_resolver())
    else:
        from cluster.launcher import Cluster

        cluster = await Cluster.start(config)
        backend = cluster.backend
    rc = config.router
    backend = AdmittedBackend(backend, rc.admission)  # both front doors share the slots
    if cluster is not None:
        cluster.metrics.add_collector(AdmissionCollector(backend))
    app = create_app(backend, api_keys=rc.api_keys, served_model_names=[config.model_name],
                     max_request_bytes=rc.max_request_bytes,
                     operator=cluster.pools if cluster else None, metrics=cluster.metrics if cluster else None,
                     admin_key=rc.admin_key, bind_host=rc.host, salt_by_api_key=rc.salt_by_api_key,
                     tool_call_parser=rc.tool_call_parser)
    if cluster is not None:
        from cluster.dashboard import mount_dashboard

        mount_dashboard(app)
    server = _Server(uvicorn.Config(app, host=rc.host, port=rc.port, log_level="info", lifespan="off",
                                           timeout_graceful_shutdown=int(GRACE_S)))
    grpc_server = None
    if rc.grpc_port is not None:
        grpc_server = await start_grpc_server(backend, rc.host, rc.grpc_port, api_keys=rc.api_keys,
                                              max_request_bytes=rc.max_request_bytes,
                                              salt_by_api_key=rc.salt_by_api_key,
                                              tool_call_parser=rc.tool_call_parser, admin_key=rc.admin_key)
    try:
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"duet: serving {config.model_name} on http://{rc.host}:{rc.port}/v1 "
                  f"(dashboard: http://{rc.host}:{rc.port}/dashboard)", file=sys.stderr, flush=True)
        await serving
    finally:
        if grpc_server is not None:
            await grpc_server.stop(GRACE_S)
        if cluster is not None:
            await cluster.stop()
        await backend.aclose()
        log.info("duet: stopped")

