"""LoraResolver: where an adapter a request names, and nobody loaded, is found on first use (vLLM's filesystem
resolver plugin, ``VLLM_LORA_RESOLVER_CACHE_DIR``, and its Hugging Face Hub one, ``VLLM_LORA_RESOLVER_HF_REPO_LIST``;
duet: ``--lora-resolver-dir`` / ``router.lora_resolver_dir``, ``--lora-resolver-hub-repos`` /
``router.lora_resolver_hub_repos``).

    resolver = LoraResolver("/adapters", hub_repos=["acme/sql-lora", "acme-tuned/*"])
    resolver.find("sql")          # "/adapters/sql" when it holds a PEFT LoRA adapter; None when there is none
    resolver.find("../etc")       # None: a client names adapters, never paths
    resolver.find("acme/sql-lora@v2")  # the Hub id itself: allowed (LoraAdapters.resolve pins and fetches it)

A name resolves to ``<dir>/<name>`` when that directory holds an ``adapter_config.json`` whose ``peft_type`` is
``LORA`` (what vLLM's resolver checks; the adapter's own checks, rank, targets and shapes, are the workers', at
load). A name is one or more ``/``-separated parts of letters, digits, ``-``, ``_`` and ``.`` (``org/sql`` is the
subdirectory ``org/sql``, as a Hub-style name lays out), never ``.`` or ``..``, and the directory it names must lie
inside the resolver's once symlinks are followed. The directory is read on every miss (adapters added to it later are
found; nothing is cached here) and must be one every worker reads at the same path (a shared volume on Kubernetes).
A name the directory does not hold is a Hub adapter when its repository (``org/name``, a revision after ``@``
allowed) is in ``hub_repos``, one by one or a whole owner as ``org/*``: only those, since any client may name one and
each is a download (the Hub's checks, pinning to a commit and fetching only the adapter's two files are
engine/hub's; what the Hub refuses is the request's 400). What loads it, and makes room for it, is
router/lora_adapters.py ``LoraAdapters.resolve``. Torch-free.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path

from engine.errors import ConfigError, LoraAdapterError
from engine.hub.ref import parse_hub_ref

log = logging.getLogger(__name__)

_PART = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MAX_NAME_PARTS = 4


class LoraResolver:
    def __init__(self, directory: str | Path | None = None, hub_repos: Sequence[str] = ()) -> None:
        self.directory = self.root = None
        if directory is not None:
            self.directory = Path(directory).expanduser()
            if not self.directory.is_dir():
                raise ConfigError(f"router.lora_resolver_dir {str(directory)!r} is not a directory")
            self.root = self.directory.resolve()
        self.hub_repos = tuple(check_hub_repos(hub_repos))

    def find(self, name: str) -> str | None:
        """The adapter directory (or Hub id) ``name`` resolves to, or None (no such adapter, or a name that is not
        one). A directory that is there but is no PEFT LoRA adapter is a ``LoraAdapterError`` (the request's 400)."""
        path = self._in_directory(name) if self.directory is not None else None
        return path if path is not None else self._on_hub(name)

    def _on_hub(self, name: str) -> str | None:
        ref = parse_hub_ref(name)
        if ref is None or ref.selector is not None:
            return None
        owner = ref.repo_id.split("/")[0]
        return name if ref.repo_id in self.hub_repos or f"{owner}/*" in self.hub_repos else None

    def _in_directory(self, name: str) -> str | None:
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


def check_hub_repos(repos: Sequence[str]) -> list[str]:
    """``repos`` as given when each is a repository id ``org/name`` or a whole owner ``org/*`` (ConfigError)."""
    if isinstance(repos, str) or not all(isinstance(r, str) for r in repos):
        raise ConfigError(f"router.lora_resolver_hub_repos must be a list of org/name or org/*, got {repos!r}")
    for repo in repos:
        ref = parse_hub_ref(repo[:-1] + "x" if repo.endswith("/*") else repo)
        if ref is None or ref.revision is not None or ref.selector is not None:
            raise ConfigError(f"router.lora_resolver_hub_repos: {repo!r} is not a repository id org/name or org/*")
    return list(repos)
