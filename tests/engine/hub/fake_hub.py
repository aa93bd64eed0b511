"""A Hugging Face Hub on 127.0.0.1, answering what huggingface_hub 2.x asks (HF_ENDPOINT points at it):

- ``GET /api/models/{org}/{name}/revision/{rev}`` (``HfApi.model_info``): ``id``, ``sha`` (the commit the
  revision points at) and ``siblings`` (``rfilename``, ``size``, ``blobId``, ``lfs`` for LFS files);
- ``HEAD`` / ``GET /{org}/{name}/resolve/{rev}/{path}`` (``hf_hub_download``): a regular file answers 200 with
  ``X-Repo-Commit``, ``ETag`` (its git blob sha1, quoted) and ``Content-Length``; an LFS file (``*.safetensors``,
  ``*.gguf``, pickles) answers 302 to a second server, the "CDN" (another origin, so the client does not follow
  the HEAD's redirect and reads the metadata off it), with ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``,
  as huggingface.co does (huggingface_hub's file_download.py ``get_hf_file_metadata``).

Errors as the Hub sends them (``X-Error-Code``, which huggingface_hub's ``hf_raise_for_status`` maps to its
exception classes): an unknown repository 404 ``RepoNotFound``; a private one without its token 401 ``RepoNotFound``;
a gated one 401 (no token) or 403 (a token without access) ``GatedRepo``; an unknown revision 404
``RevisionNotFound``; an unknown file 404 ``EntryNotFound``. Every request is recorded (``requests``).
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch / tag -> commit
    gated: bool = False
    private: bool = False
    tokens: tuple[str, ...] = ()  # the tokens with access (gated or private)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 -> bytes (the CDN's)
        self.requests: list[tuple[str, str]] = []  # (method, path) in arrival order
        self._servers: list[ThreadingHTTPServer] = []

    # ---- content -------------------------------------------------------------------------------
    def add_commit(self, repo_id: str, files: dict[str, bytes | Path], refs: tuple[str, ...] = ("main",)) -> str:
        """A commit holding ``files`` (bytes, or a file or directory whose files are read); ``refs`` point at it."""
        repo = self.repos.setdefault(repo_id, Repo())
        content: dict[str, bytes] = {}
        for name, value in files.items():
            if isinstance(value, Path) and value.is_dir():
                content.update({f"{name}/{p.relative_to(value).as_posix()}".lstrip("/"): p.read_bytes()
                                for p in sorted(value.rglob("*")) if p.is_file()})
            else:
                content[name] = value.read_bytes() if isinstance(value, Path) else value
        digest = hashlib.sha1(repr(len(repo.commits)).encode())
        for name in sorted(content):
            digest.update(name.encode() + git_blob_sha1(content[name]).encode())
        commit = digest.hexdigest()
        repo.commits[commit] = content
        for ref in refs:
            repo.refs[ref] = commit
        for data in content.values():
            self.blobs[hashlib.sha256(data).hexdigest()] = data
        return commit

    def files_requested(self, repo_id: str) -> list[str]:
        """The paths of ``repo_id`` hf_hub_download asked for (its HEAD on resolve, before the bytes), in order."""
        prefix = f"/{repo_id}/resolve/"
        return [p.split("/", 5)[5] for m, p in self.requests if m == "HEAD" and p.startswith(prefix)]

    def api_calls(self, repo_id: str) -> list[str]:
        return [p for _, p in self.requests if p.startswith(f"/api/models/{repo_id}")]

    # ---- serving -------------------------------------------------------------------------------
    def start(self) -> FakeHub:
        hub = self
        cdn = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub, cdn=True))
        api = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub, cdn=False))
        self.cdn_url = f"http://127.0.0.1:{cdn.server_address[1]}"
        self.endpoint = f"http://127.0.0.1:{api.server_address[1]}"
        for server in (cdn, api):
            threading.Thread(target=server.serve_forever, daemon=True).start()
        self._servers = [api, cdn]
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers = []

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- answers -------------------------------------------------------------------------------
    def answer(self, method: str, path: str, auth: str | None) -> tuple[int, dict[str, str], bytes]:
        self.requests.append((method, path))
        parts = path.split("/")
        if path.startswith("/api/models/"):  # /api/models/org/name[/revision/rev]
            repo_id = "/".join(parts[3:5])
            revision = unquote(parts[6]) if len(parts) > 6 else "main"
            return self._model_info(repo_id, revision, auth)
        if len(parts) > 5 and parts[3] == "resolve":  # /org/name/resolve/rev/path
            return self._resolve(method, "/".join(parts[1:3]), unquote(parts[4]), unquote("/".join(parts[5:])), auth)
        return 404, {}, b"not found"

    def _access(self, repo_id: str, auth: str | None) -> tuple[int, dict[str, str], bytes] | None:
        repo = self.repos.get(repo_id)
        token = auth.removeprefix("Bearer ") if auth else None
        if repo is None:
            return _error(404, "RepoNotFound", "Repository not found")
        if repo.gated and token not in repo.tokens:
            status = 403 if token else 401
            return _error(status, "GatedRepo", f"Access to model {repo_id} is restricted")
        if repo.private and token not in repo.tokens:
            return _error(401, "RepoNotFound", "Repository not found")
        return None

    def _commit(self, repo_id: str, revision: str, auth: str | None) -> tuple[str | None, tuple | None]:
        """(the commit ``revision`` names, None) if the caller may read it; else (None, the error answer)."""
        denied = self._access(repo_id, auth)
        if denied:
            return None, denied
        repo = self.repos[repo_id]
        commit = revision if revision in repo.commits else repo.refs.get(revision)
        return (commit, None) if commit else (None, _error(404, "RevisionNotFound", f"Invalid rev id: {revision}"))

    def _model_info(self, repo_id: str, revision: str, auth: str | None):
        commit, refused = self._commit(repo_id, revision, auth)
        if refused:
            return refused
        siblings = []
        for name, data in sorted(self.repos[repo_id].commits[commit].items()):
            entry = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(entry)
        body = json.dumps({"_id": repo_id, "id": repo_id, "sha": commit, "siblings": siblings, "private": False,
                           "gated": "auto" if self.repos[repo_id].gated else False}).encode()
        return 200, {"Content-Type": "application/json"}, body

    def _resolve(self, method: str, repo_id: str, revision: str, name: str, auth: str | None):
        commit, refused = self._commit(repo_id, revision, auth)
        if refused:
            return refused
        data = self.repos[repo_id].commits[commit].get(name)
        if data is None:
            status, headers, body = _error(404, "EntryNotFound", f"{name} does not exist")
            return status, {**headers, "X-Repo-Commit": commit}, body
        if name.endswith(LFS_SUFFIXES):
            sha256 = hashlib.sha256(data).hexdigest()
            return 302, {"Location": f"{self.cdn_url}/blobs/{sha256}", "X-Repo-Commit": commit,
                         "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data)),
                         "ETag": f'"{git_blob_sha1(sha256.encode())}"', "Content-Length": "0"}, b""
        return 200, {"X-Repo-Commit": commit, "ETag": f'"{git_blob_sha1(data)}"',
                     "Content-Type": "application/octet-stream"}, data

    def answer_cdn(self, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        self.requests.append((f"CDN-{method}", path))
        data = self.blobs.get(path.removeprefix("/blobs/"))
        return (404, {}, b"no such blob") if data is None else (200, {"Content-Type": "application/octet-stream"}, data)


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, str], bytes]:
    return status, {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}, \
        json.dumps({"error": message}).encode()


def _handler(hub: FakeHub, cdn: bool):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, send_body: bool) -> None:
            path = urlsplit(self.path).path
            status, headers, body = hub.answer_cdn(self.command, path) if cdn else \
                hub.answer(self.command, path, self.headers.get("Authorization"))
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def do_GET(self) -> None:
            self._reply(True)

        def do_HEAD(self) -> None:
            self._reply(False)

        def log_message(self, *args) -> None:  # the test's log stays quiet
            pass

    return Handler
