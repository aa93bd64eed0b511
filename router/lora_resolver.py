"""LoraResolver: where an adapter a request names, and nobody loaded, is found on first use (vLLM's filesystem
resolver plugin, ``VLLM_LORA_RESOLVER_CACHE_DIR``; duet: ``--lora-resolver-dir`` / ``router.lora_resolver_dir``).

    resolver = LoraResolver("/adapters")
    resolver.find("sql")          # "/adapters/sql" when it holds a PEFT LoRA adapter; None when there is none
    resolver.find("../etc")       # None: a client names adapters, never paths

A name resolves to ``<dir>/<name>`` when that directory holds an ``adapter_config.json`` whose ``peft_type`` is
``LORA`` (what vLLM's resolver checks; the adapter's own checks, rank, targets and shapes, are the workers', at
load). A name is one or more ``/``-separated parts of letters, digits, ``-``, ``_`` and ``.`` (``org/sql`` is the
subdirectory ``org/sql``, as a Hub-style name lays out), never ``.`` or ``..``, and the directory it names must lie
inside the resolver's once symlinks are followed. The directory is read on every miss (adapters added to it later are
found; nothing is cached here) and must be one every worker reads at the same path (a shared volume on Kubernetes).
What loads it, and makes room for it, is router/lora_adapters.py ``LoraAdapters.resolve``. Torch-free.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from engine.errors import ConfigError, LoraAdapterError

log = logging.getLogger(__name__)

_PART = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MAX_NAME_PARTS = 4


class LoraResolver:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).expanduser()
        if not self.directory.is_dir():
            raise ConfigError(f"router.lora_resolver_dir {str(directory)!r} is not a directory")
        self.root = self.directory.resolve()

    def find(self, name: str) -> str | None:
        """The adapter directory ``name`` resolves to, or None (no such adapter, or a name that is not one).
        A directory that is there but is no PEFT LoRA adapter is a ``LoraAdapterError`` (the request's 400)."""
        parts = name.split("/")
        if not name or len(parts) > MAX_NAME_PARTS or any(p in (".", "..") or not _PART.fullmatch(p) for p in parts):
            return None
        path = self.directory.joinpath(*parts)
        if not path.resolve().is_relative_to(self.root):  # a symlink out of the directory
            log.warning("LoRA resolver: %s leaves %s; not served", path, self.root)
            return None
        config = path / "adapter_config.json"
        if not config.is_file():
            return None
        try:
            peft_type = json.loads(config.read_text()).get("peft_type")
        except (OSError, ValueError, AttributeError) as e:
            raise LoraAdapterError(f"LoRA adapter {name!r}: {config.name} is not readable JSON ({e})") from None
        if peft_type != "LORA":
            raise LoraAdapterError(f"LoRA adapter {name!r}: peft_type {peft_type!r}; only LORA adapters are served")
        return str(path)
