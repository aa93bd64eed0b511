"""A Hub id → one commit and a local snapshot holding the files duet reads, through huggingface_hub.

    resolved = resolve(HubRef("org/name", "main"))     # the listing, then each missing file fetched into the cache
    resolved.path                                      # the snapshot directory, or the .gguf file in it
    pin_model("org/name:Q8_0")                         # -> "org/name@<40-hex commit>:name.Q8_0.gguf"
    local_checkpoint(model)                            # a path as is; a Hub id's checkpoint in the cache
    pin_adapter("org/lora") / resolve_adapter(...)     # a PEFT LoRA adapter's repository: its two files

Everything is huggingface_hub's standard machinery, configured by its environment (read once, ``HubSettings``):
the cache (``HF_HUB_CACHE`` / ``HF_HOME``; engine/hub/cache.py), the endpoint (``HF_ENDPOINT``), the token
(``HF_TOKEN``, else the ``hf auth login`` file) and offline mode (``HF_HUB_OFFLINE=1``: the cache only, no request).

1. Listing: ``HfApi.model_info(repo, revision)`` (``GET /api/models/{repo}/revision/{rev}``) gives the commit the
   revision points at and the repository's files; offline, the cached snapshot's files. If the Hub cannot be
   reached, the cached snapshot of that revision stands in, with a warning (what transformers does); without one,
   the error says both. A pinned id (a commit hash) whose cached snapshot already holds every file it needs skips
   the listing: no request at all (how workers on a node that has the files start).
2. Choosing: engine/hub/files.py (the engine's files only; never a pickle).
3. Fetching: ``hf_hub_download(revision=<commit>)`` per missing file (``HEAD`` then ``GET /{repo}/resolve/{commit}/
   {file}``), huggingface_hub's progress bars on stderr and one log line per file; a safetensors index first, then
   the shards it names. The branch or tag is recorded in ``refs/`` (as ``snapshot_download`` does), so offline mode
   finds the snapshot by the same name later.

Pinning: the process that launches a cluster resolves once (``pin_model``) and gives every worker the pinned id
(commit hash, and the GGUF file's name). A worker resolves that id itself: from its own cache, else by fetching
exactly that commit, so workers on other nodes load the same bytes even if the branch moves meanwhile. Workers
get the launcher's ``HF_*`` variables (``hub_env``; cluster/spawn.py), a token included, as vLLM's Ray workers
get its driver's environment.

Errors (``ModelLoadError``) name what is missing: no network and not cached; a gated repository (HTTP 401/403
``GatedRepo``: accept its terms, set ``HF_TOKEN``); an unknown or private repository (401/404 ``RepoNotFound``),
an unknown revision (404 ``RevisionNotFound``); and, from files.py, a repository without weights duet reads or a
quantization that matches no file, or several.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.hub.cache import CachedSnapshot, cached_snapshot, is_complete, repo_folder, write_ref
from engine.hub.files import INDEX, Selection, index_shards, select_adapter_files, select_files
from engine.hub.ref import HubRef, is_hub_id, parse_model

log = logging.getLogger(__name__)

HUB_ENV_PREFIX = "HF_"


@dataclass(frozen=True)
class HubSettings:
    endpoint: str
    cache_dir: Path
    offline: bool
    token: str | None = None  # None: huggingface_hub's own (HF_TOKEN, else the login file)

    def __post_init__(self) -> None:  # the snapshot paths handed out are absolute, as huggingface_hub's
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser().resolve())

    @classmethod
    def from_env(cls) -> HubSettings:
        from huggingface_hub import constants

        return cls(constants.ENDPOINT, Path(constants.HF_HUB_CACHE), constants.is_offline_mode())


@dataclass(frozen=True)
class ResolvedModel:
    ref: HubRef  # as asked
    commit: str
    snapshot: Path
    selection: Selection

    @property
    def path(self) -> Path:
        """The checkpoint: the snapshot directory, or its .gguf file."""
        return self.snapshot / self.selection.gguf_file if self.selection.gguf_file else self.snapshot

    @property
    def pinned(self) -> HubRef:
        return self.ref.pinned(self.commit, self.selection.gguf_file)


@dataclass(frozen=True)
class _Listing:
    commit: str
    files: dict[str, int | None]  # path -> bytes (None: unknown)
    from_cache: bool  # offline or the Hub unreachable: nothing can be fetched


def hub_env(config: EngineConfig) -> dict[str, str]:
    """The ``HF_*`` variables of this process, for the workers of a cluster whose model (or draft model) is on the
    Hub, or that serves LoRA adapters (a Hub id may be loaded at run time); none otherwise."""
    spec = config.speculative_config
    models = [config.model] + ([spec.model] if spec is not None and spec.needs_draft_model else [])
    if not any(is_hub_id(m) for m in models) and not config.lora_slots:
        return {}
    return {k: v for k, v in os.environ.items() if k.startswith(HUB_ENV_PREFIX)}


def pin_engine_config(config: EngineConfig, settings: HubSettings | None = None) -> EngineConfig:
    """``config`` with its model, a speculative draft model and LoRA adapters named by Hub id pinned (``pin_model``,
    ``pin_adapter``); unchanged for local paths."""
    changes: dict = {}
    model = pin_model(config.model, settings)
    if model != config.model:
        changes["model"] = model
    spec = config.speculative_config
    if spec is not None and spec.needs_draft_model:
        draft = pin_model(spec.model, settings)
        if draft != spec.model:
            changes["speculative_config"] = dataclasses.replace(spec, model=draft)
    if config.lora_modules:
        modules = tuple((name, pin_adapter(path, settings)) for name, path in config.lora_modules)
        if modules != tuple(config.lora_modules):
            changes["lora_modules"] = dict(modules)
    return config.replace(**changes) if changes else config


def resolve_model(model: str | Path, settings: HubSettings | None = None) -> ResolvedModel | None:
    """None for a local path; a Hub id resolved (``resolve``)."""
    ref = parse_model(model)
    return None if ref is None else resolve(ref, settings)


def local_checkpoint(model: str | Path, settings: HubSettings | None = None) -> Path:
    """The local directory or GGUF file ``model`` names: a path as it is, a Hub id's checkpoint in the cache."""
    resolved = resolve_model(model, settings)
    return Path(model) if resolved is None else resolved.path


def pin_model(model: str | Path, settings: HubSettings | None = None) -> str:
    """``model`` unchanged if it is a local path; a Hub id resolved, fetched, and pinned to its commit (and file)."""
    resolved = resolve_model(model, settings)
    if resolved is None:
        return str(model)
    pinned = str(resolved.pinned)
    if pinned != str(model):
        log.info("model %s is %s (snapshot %s)", model, pinned, resolved.path)
    return pinned


def resolve_adapter(path: str | Path, settings: HubSettings | None = None) -> Path:
    """A LoRA adapter's directory: ``path`` as it is when it exists, else a Hub id's snapshot of the adapter's two
    files (engine/hub/files.py ``select_adapter_files``), fetched into the cache as a model is."""
    ref = parse_model(path)
    return Path(path) if ref is None else resolve(ref, settings, select_adapter_files).snapshot


def pin_adapter(path: str | Path, settings: HubSettings | None = None) -> str:
    """``path`` unchanged if it exists; a Hub id resolved, fetched and pinned to its commit (``org/name@<hash>``),
    what every worker is given, as for the model (``pin_model``)."""
    ref = parse_model(path)
    if ref is None:
        return str(path)
    resolved = resolve(ref, settings, select_adapter_files)
    log.info("LoRA adapter %s is %s (snapshot %s)", path, resolved.pinned, resolved.snapshot)
    return str(resolved.pinned)


def resolve(ref: HubRef, settings: HubSettings | None = None, select=select_files) -> ResolvedModel:
    """``select``: which files of the repository (engine/hub/files.py: a model's, or ``select_adapter_files``)."""
    settings = settings or HubSettings.from_env()
    where = f"{ref.repo_id}@{ref.revision or 'main'}"
    if ref.is_pinned:  # a cached, complete snapshot of an immutable commit: no request
        snap = cached_snapshot(settings.cache_dir, ref.repo_id, ref.revision)
        selection = _select_cached(snap, ref, where, select) if snap is not None else None
        if selection is not None and is_complete(snap, selection):
            return ResolvedModel(ref, snap.commit, snap.path, selection)
    listing = _list(ref, settings, where)
    selection = select(list(listing.files), ref.selector, where)
    snapshot = _fetch(ref, listing, selection, settings, where)
    if not listing.from_cache:
        write_ref(settings.cache_dir, ref.repo_id, ref.revision or "main", listing.commit)
    return ResolvedModel(ref, listing.commit, snapshot, selection)


def _select_cached(snap: CachedSnapshot, ref: HubRef, where: str, select=select_files) -> Selection | None:
    try:
        return select(snap.files, ref.selector, where)
    except ModelLoadError:  # the cache holds part of the commit: the listing decides what is missing
        return None


def _list(ref: HubRef, settings: HubSettings, where: str) -> _Listing:
    revision = ref.revision or "main"
    if settings.offline:
        snap = cached_snapshot(settings.cache_dir, ref.repo_id, revision)
        if snap is None:
            raise ModelLoadError(f"{where} is not in the Hugging Face cache {settings.cache_dir}, and HF_HUB_OFFLINE=1 "
                                 "forbids fetching it (unset it, or fetch the model once online)")
        log.info("%s: offline (HF_HUB_OFFLINE=1), the cached snapshot %s", where, snap.commit)
        return _Listing(snap.commit, dict.fromkeys(snap.files), from_cache=True)
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi(endpoint=settings.endpoint, token=settings.token).model_info(
            ref.repo_id, revision=revision, files_metadata=True)
    except HfHubHTTPError as e:
        raise _http_error(e, ref, settings) from None
    except _network_errors() as e:
        snap = cached_snapshot(settings.cache_dir, ref.repo_id, revision)
        if snap is None:
            raise ModelLoadError(f"cannot reach {settings.endpoint} ({_reason(e)}), and {where} is not in the Hugging "
                                 f"Face cache {settings.cache_dir}") from None
        log.warning("cannot reach %s (%s): serving %s from its cached snapshot %s, which the Hub could not confirm "
                    "is current", settings.endpoint, _reason(e), where, snap.commit)
        return _Listing(snap.commit, dict.fromkeys(snap.files), from_cache=True)
    if not info.sha:
        raise ModelLoadError(f"{settings.endpoint} listed {where} without its commit hash: not a Hub API answer "
                             "(check HF_ENDPOINT)")
    return _Listing(info.sha, {s.rfilename: s.size for s in info.siblings or ()}, from_cache=False)


def _fetch(ref: HubRef, listing: _Listing, selection: Selection, settings: HubSettings, where: str) -> Path:
    snapshot = repo_folder(settings.cache_dir, ref.repo_id) / "snapshots" / listing.commit
    t0, fetched = time.monotonic(), []
    fetched += _download(ref, selection.files, listing, snapshot, settings, where)
    if INDEX in selection.files:
        shards = index_shards(snapshot / INDEX, list(listing.files), where)
        fetched += _download(ref, shards, listing, snapshot, settings, where)
    if fetched:
        total = sum(listing.files.get(f) or 0 for f in fetched)
        log.info("%s: fetched %d files (%s) at commit %s in %.1f s into %s", where, len(fetched), _mb(total),
                 listing.commit, time.monotonic() - t0, snapshot)
    return snapshot


def _download(ref: HubRef, names, listing: _Listing, snapshot: Path, settings: HubSettings, where: str) -> list[str]:
    """Fetch each of ``names`` not yet in ``snapshot``; the names fetched."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    fetched = []
    for name in names:
        if (snapshot / name).is_file():
            continue
        if listing.from_cache:
            raise ModelLoadError(f"{where}: {name} is not in the cached snapshot {listing.commit} "
                                 f"({settings.cache_dir}), and the Hub cannot be asked for it")
        size = listing.files.get(name)
        log.info("%s: fetching %s%s", where, name, f" ({_mb(size)})" if size is not None else "")
        try:
            hf_hub_download(ref.repo_id, name, revision=listing.commit, cache_dir=settings.cache_dir,
                            endpoint=settings.endpoint, token=settings.token)
        except HfHubHTTPError as e:
            raise _http_error(e, ref, settings) from None
        except (LocalEntryNotFoundError, *_network_errors()) as e:
            raise ModelLoadError(f"{where}: fetching {name} failed: cannot reach {settings.endpoint} "
                                 f"({_reason(e)})") from None
        fetched.append(name)
    return fetched


def _http_error(e, ref: HubRef, settings: HubSettings) -> ModelLoadError:
    from huggingface_hub import get_token
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    status = e.response.status_code if getattr(e, "response", None) is not None else "?"
    has_token = bool(settings.token or get_token())
    page = f"{settings.endpoint}/{ref.repo_id}"
    if isinstance(e, GatedRepoError):
        tail = ("the token in use has no access to it" if has_token else "no token is set")
        return ModelLoadError(f"{ref.repo_id} is a gated model (HTTP {status}) and {tail}: accept its terms on "
                              f"{page} with your account, then set HF_TOKEN to a token of that account")
    if isinstance(e, RevisionNotFoundError):
        return ModelLoadError(f"{ref.repo_id} has no revision {ref.revision!r} (HTTP {status}): name a branch, tag "
                              f"or commit hash of {page}")
    if isinstance(e, RepositoryNotFoundError) or status in (401, 403):
        tail = ("or it is private and the token in use has no access" if has_token
                else "or it is private or gated and no token is set (HF_TOKEN)")
        return ModelLoadError(f"{ref.repo_id}: no such model repository on {settings.endpoint}, {tail} (HTTP "
                              f"{status}); and no local path {str(ref)!r} exists")
    return ModelLoadError(f"{ref.repo_id}: {settings.endpoint} answered HTTP {status} ({_reason(e)})")


def _network_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub lets through when no answer came: its HTTP client's transport errors (huggingface_hub
    2.x talks through httpx2) and its own offline-mode refusal."""
    import httpx2
    from huggingface_hub.errors import OfflineModeIsEnabled

    return httpx2.TransportError, OfflineModeIsEnabled


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.1f} MB" if num_bytes >= 100_000 else f"{num_bytes / 1e3:.1f} kB"


def _reason(e: BaseException) -> str:
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0]}" if first else type(e).__name__
