"""The Hugging Face cache as huggingface_hub lays it out, read (and its refs written) without the network.

    <cache>/models--org--name/
        blobs/<etag>                         the files' bytes (a git blob sha1, or an LFS file's sha256)
        refs/<revision>                      a branch or tag -> the commit hash it pointed to when last fetched
        snapshots/<commit>/<path>            symlinks into blobs/: the files fetched at that commit

``<cache>`` is ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub`` (huggingface_hub's
``constants.HF_HUB_CACHE``). Only what a fetch wrote is there, so a cached snapshot is a subset of the
repository: a listing of it is what offline mode (``HF_HUB_OFFLINE=1``), or an unreachable Hub, has to choose from.
A file whose symlink dangles (its blob deleted) is not listed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError
from engine.hub.files import INDEX, Selection, index_shards
from engine.hub.ref import COMMIT_HASH


def repo_folder(cache_dir: Path, repo_id: str) -> Path:
    """huggingface_hub's ``repo_folder_name`` for a model repository."""
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


@dataclass(frozen=True)
class CachedSnapshot:
    commit: str
    path: Path
    files: list[str]  # relative paths, '/'-separated


def cached_commit(cache_dir: Path, repo_id: str, revision: str) -> str | None:
    """The commit ``revision`` (a branch, tag or commit hash) resolves to in the cache, if it was fetched."""
    if COMMIT_HASH.fullmatch(revision):
        return revision
    ref = repo_folder(cache_dir, repo_id) / "refs" / revision
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if COMMIT_HASH.fullmatch(commit) else None


def cached_snapshot(cache_dir: Path, repo_id: str, revision: str) -> CachedSnapshot | None:
    """The files cached at the commit ``revision`` names; None if that snapshot is not in the cache."""
    commit = cached_commit(cache_dir, repo_id, revision)
    if commit is None:
        return None
    snap = repo_folder(cache_dir, repo_id) / "snapshots" / commit
    if not snap.is_dir():
        return None
    files = sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())
    return CachedSnapshot(commit, snap, files)


def is_complete(snapshot: CachedSnapshot, selection: Selection) -> bool:
    """Whether every file of ``selection`` is in ``snapshot``, an index's shards included."""
    have = set(snapshot.files)
    if not all(f in have for f in selection.files):
        return False
    if INDEX not in selection.files:
        return True
    try:
        return all(s in have for s in index_shards(snapshot.path / INDEX, snapshot.files, ""))
    except ModelLoadError:  # an index that does not parse, or names a shard not cached: not complete
        return False


def write_ref(cache_dir: Path, repo_id: str, revision: str, commit: str) -> None:
    """Record that ``revision`` (a branch or tag) pointed at ``commit``, as huggingface_hub's
    ``_cache_commit_hash_for_specific_revision`` does, so offline mode finds it by name later."""
    if revision == commit:
        return
    ref = repo_folder(cache_dir, repo_id) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.exists() or ref.read_text() != commit:
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
