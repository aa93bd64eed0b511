"""What ``--model`` names: a local checkpoint (a directory or a GGUF file), or a model on the Hugging Face Hub.

    org/name                      the repository's default branch (main)
    org/name@revision             a branch, a tag or a commit hash
    org/name:Q4_K_M               a GGUF repository: the one .gguf file of that quantization (engine/hub/files.py)
    org/name:model.Q8_0.gguf      ... or one file, by name
    org/name@revision:Q4_K_M      both: the revision first (git forbids ':' in a ref name, so the split is exact)

A string that names an existing path is that path, always (as in vLLM), even when it also reads as ``org/name``.
Anything else must be a Hub id of the form above: a bare name (``gpt2``), a path that does not exist
(``/models/x``) or a malformed id is a ``ModelLoadError`` that says both readings failed. The repository part
follows the Hub's rule (huggingface_hub's ``validate_repo_id``): letters, digits, ``-``, ``_``, ``.``, not
starting or ending with ``-`` or ``.``, no ``--`` or ``..``, at most 96 characters a part; an organisation is
required, so that a typo'd relative path is never read as a one-word repository.

A *pinned* id carries a full 40-hex commit hash (and, for a GGUF repository, the file's name): what the process
that launches a cluster hands every worker (engine/hub/resolve.py ``pin_model``), so that they all load the same
bytes. Pure: no network, no huggingface_hub import (the router and the config code parse ids too).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

_PART = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_REPO = re.compile(rf"{_PART}/{_PART}")
_REVISION = re.compile(r"[^\s:@]+")
_SELECTOR = re.compile(r"[^\s:@]+")
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
FORM = "org/name[@revision][:QUANT | :file.gguf]"


@dataclass(frozen=True)
class HubRef:
    """A model on the Hub: ``repo_id``, the ``revision`` asked for (None: main) and, for a GGUF repository, a
    ``selector``: a quantization tag (``Q4_K_M``) or a file name ending in ``.gguf``."""

    repo_id: str
    revision: str | None = None
    selector: str | None = None

    @property
    def is_pinned(self) -> bool:
        """A commit hash: the snapshot can never change (a branch or a tag can)."""
        return self.revision is not None and COMMIT_HASH.fullmatch(self.revision) is not None

    @property
    def selects_file(self) -> bool:
        return self.selector is not None and self.selector.lower().endswith(".gguf")

    def pinned(self, commit: str, gguf_file: str | None) -> HubRef:
        return HubRef(self.repo_id, commit, gguf_file)

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        sel = f":{self.selector}" if self.selector else ""
        return f"{self.repo_id}{rev}{sel}"


def parse_hub_ref(text: str) -> HubRef | None:
    """``text`` read as a Hub id, or None when it is not one (no existence check: see ``parse_model``)."""
    repo, sep, selector = text.partition(":")
    repo, at, revision = repo.partition("@")
    if not _REPO.fullmatch(repo) or "--" in repo or ".." in repo:
        return None
    if (at and not _REVISION.fullmatch(revision)) or (sep and not _SELECTOR.fullmatch(selector)):
        return None
    return HubRef(repo, revision or None, selector or None)


def parse_model(model: str | Path) -> HubRef | None:
    """None for an existing local path (a checkpoint directory or file); the Hub id ``model`` names otherwise;
    a ``ModelLoadError`` when it is neither."""
    if isinstance(model, Path) or (model and Path(model).exists()):
        return None
    ref = parse_hub_ref(model)
    if ref is None:
        raise ModelLoadError(f"model {model!r}: no such file or directory, and not a Hugging Face Hub id "
                             f"({FORM})")
    return ref


def is_hub_id(model: str | Path) -> bool:
    """Whether ``model`` names a Hub model (not an existing path, and a well-formed id)."""
    return not isinstance(model, Path) and parse_hub_ref(model) is not None and not Path(model).exists()


def served_name(model: str | Path) -> str | None:
    """The name a Hub model is served under by default: its repository id (as vLLM serves ``--model org/name``);
    None for anything else."""
    return parse_hub_ref(str(model)).repo_id if is_hub_id(model) else None
