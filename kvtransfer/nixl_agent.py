"""Creating a NIXL agent and naming memory for it (split from nixl_transport.py, which uses them)."""

from __future__ import annotations

import logging
import os
import threading

import torch
from nixl._api import nixl_agent, nixl_agent_config

from kvtransfer.errors import KVConfigError

logger = logging.getLogger("kvtransfer.nixl_transport")

DEFAULT_PROGRESS_DELAY_US = 1000  # NIXL progress thread's poll() timeout; 0 = nixl's default (spin)
_AGENT_CREATION_LOCK = threading.Lock()  # guards the bindings swap in _create_agent


def _memory_location(device: torch.device) -> tuple[str, int]:
    """NIXL memory type and device id for a tensor on `device`."""
    if device.type == "cpu":
        return "DRAM", 0
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    raise KVConfigError(f"NIXL moves host (cpu) or CUDA memory, not {device}")


class _BindingsWithProgressDelay:
    """nixl._api's view of the C++ bindings, except that new agents get `pthrDelay = delay_us`."""

    def __init__(self, bindings, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str):
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config):  # noqa: N802 - mirrors the binding's name
        config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)


def _create_agent(name: str, backends: list[str], progress_delay_us: int) -> nixl_agent:
    """A nixl_agent whose progress thread sleeps in poll() instead of spinning.

    nixl 1.5.1's Python wrapper hard-codes the progress thread's delay to 0, and the UCX progress
    thread then polls with a zero timeout: it burns a whole core per worker even when idle (measured:
    ~100% of a core idle, 0.5-5% with a 1-10 ms delay). The wrapper has no knob, so during the
    constructor we show it a bindings object whose nixlAgent() sets the delay first. The thread still
    wakes on UCX events at once (armed event fd); the delay only bounds a sweep when an event is
    missed. Over TCP 1 ms keeps a 32 KiB READ at ~0.2 ms median / 0.3 ms p90, 10 ms lets p90 reach
    ~4 ms, 0 (spinning) ~0.6 ms median / 30 ms p90 on 2 shared cores.
    """
    import nixl._api as nixl_api

    bindings = getattr(nixl_api, "nixlBind", None)
    if progress_delay_us <= 0 or bindings is None or not hasattr(bindings, "nixlAgent"):
        if progress_delay_us > 0:
            logger.warning("cannot set the NIXL progress delay on this nixl version; its thread may spin")
        return nixl_agent(name, nixl_agent_config(backends=backends))
    with _AGENT_CREATION_LOCK:
        nixl_api.nixlBind = _BindingsWithProgressDelay(bindings, progress_delay_us)
        try:
            return nixl_agent(name, nixl_agent_config(backends=backends))
        finally:
            nixl_api.nixlBind = bindings


def _ucx_env_summary() -> str:
    return f"UCX_TLS={os.environ.get('UCX_TLS', '<unset>')}"
