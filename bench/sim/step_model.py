"""Step-time models: how long one engine step takes, given what the scheduler put in it.

The simulator replaces the model forward with ``model.step_time_s(shape)``, where ``StepShape`` is read
from the real scheduler's ``SchedulerOutput`` (before ``on_step_computed``), so a step that mixes prompt
chunks and decode tokens costs what its parts cost together, as in the engine.

Two models:

* ``FittedStepModel`` (CPU): calibrated on the real duet engine by bench/sim/calibrate.py. On a CPU the
  projections of a step cost a *concave* function of its token count (one token reads all weights from
  memory — a GEMV; hundreds of tokens run at GEMM speed), so the token term is piecewise linear with knots
  at ``TOKEN_KNOTS`` (slopes fitted, non-negative), plus terms linear in prompt-attention work, decode
  context, decode buckets (the CPU decode attention runs one SDPA per 8 sequences) and sampled rows:

      t = c0 + Σ_k s_k · clip(N − knot_k, 0, knot_{k+1} − knot_k) + a_p · A + a_d · C + b · ⌈D/8⌉ + h · S

  N = tokens run, A = Σ over prompt chunks n·(start + n) (the CPU prompt attention, kernels/
  prefill_attention.py's torch reference, scores the whole q × kv rectangle under a mask, so the causal
  half is not saved), C = Σ decode contexts, D = decode sequences, S = sampled rows (lm_head). Beyond the
  last knot the last slope continues.

* ``RooflineStepModel`` (GPU, no measurement): ``t = overhead + max(FLOPs / (MFU · peak), bytes / (eff · HBM
  bandwidth))`` with FLOPs = 2·(matmul params)·N + 4·layers·heads·head_dim·(A + C) + 2·hidden·vocab·S and
  bytes = weights + KV read (C + prompt contexts) + KV written (N). The figures are in ``GpuSpec`` /
  ``ModelSpec`` and written into every result; a quantized KV cache (``ModelSpec.kv_cache_dtype``) shrinks the KV
  bytes read and written, the blocks' bytes on the wire, and grows the blocks a GPU holds.

``TransferModel`` is the KV handoff: ``fixed_s + blocks · bytes_per_block / bytes_per_s``.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

TOKEN_KNOTS = (1, 2, 4, 8, 16, 64, 256, 1024)  # a step runs >= 1 token: the constant holds the first
DECODE_BUCKET = 8  # engine's CPU decode attention: one SDPA per bucket of 8 sequences (kernels/ torch refs)


@dataclass(frozen=True)
class StepShape:
    num_tokens: int = 0  # N: every token the step runs (prompt chunks + one per decode sequence)
    num_prefill_seqs: int = 0
    prefill_attn_pairs: float = 0.0  # Σ n·(start + (n+1)/2) over prompt chunks (causal query·key pairs)
    prefill_attn_rect: float = 0.0  # A: Σ n·(start + n): the CPU reference scores the whole masked rectangle
    prefill_ctx_tokens: int = 0  # Σ (start + n) over prompt chunks (KV the chunks read, once)
    num_decode_seqs: int = 0  # D
    decode_ctx_tokens: int = 0  # C: Σ over decode sequences of the keys they attend
    num_sampled: int = 0  # S: rows that go through lm_head


def step_shape(sched) -> StepShape:
    """The shape of an ``engine.sched.output.SchedulerOutput``; call it before ``on_step_computed``. A
    scheduled request with one new token takes the decode-attention path (as in engine/model_runner.py)."""
    n_tok = n_pf = n_dec = ctx_d = ctx_p = n_samp = 0
    pairs = rect = 0.0
    for s in sched.scheduled:
        start, n = s.request.num_computed_tokens, s.num_new_tokens
        n_tok += n
        if n > 1:
            n_pf += 1
            pairs += n * (start + (n + 1) / 2)
            rect += n * (start + n)
            ctx_p += start + n
        else:
            n_dec += 1
            ctx_d += start + 1
        if start + n == s.request.num_tokens:
            n_samp += 1
    return StepShape(n_tok, n_pf, pairs, rect, ctx_p, n_dec, ctx_d, n_samp)


class StepModel(Protocol):
    name: str

    def step_time_s(self, shape: StepShape) -> float: ...

    def describe(self) -> dict: ...


# ---- the fitted CPU model ------------------------------------------------------------------------------

def feature_names() -> list[str]:
    seg = [f"tokens_{a}_{b}" for a, b in zip(TOKEN_KNOTS, TOKEN_KNOTS[1:])]
    return ["const", *seg, "prefill_attn_rect", "decode_ctx_tokens", "decode_buckets", "sampled"]


def features(shape: StepShape) -> list[float]:
    n = shape.num_tokens
    knots = TOKEN_KNOTS
    seg = [min(max(n - a, 0), b - a) for a, b in zip(knots, knots[1:])]
    seg[-1] += max(0, n - knots[-1])  # the last slope continues beyond the last knot
    return [1.0, *seg, shape.prefill_attn_rect, float(shape.decode_ctx_tokens),
            float(math.ceil(shape.num_decode_seqs / DECODE_BUCKET)), float(shape.num_sampled)]


@dataclass(frozen=True)
class FittedStepModel:
    coefficients: dict[str, float]
    name: str = "fitted"

    def step_time_s(self, shape: StepShape) -> float:
        c = self.coefficients
        return sum(c.get(k, 0.0) * x for k, x in zip(feature_names(), features(shape)))

    def describe(self) -> dict:
        return {"kind": "fitted", "name": self.name, "coefficients": dict(self.coefficients),
                "form": f"const + piecewise-linear(tokens, knots {TOKEN_KNOTS}) + prefill_attn_rect + decode_ctx_tokens + "
                        "decode_buckets + sampled"}

    @classmethod
    def load(cls, path: Path, threads: int = 1) -> FittedStepModel:
        """The fit for ``threads`` torch threads from a bench/sim/calibrate.py JSON."""
        data = json.loads(Path(path).read_text())
        fits = data["fits"]
        if str(threads) not in fits:
            raise ValueError(f"{path} has no fit for {threads} thread(s) (it has {sorted(fits)})")
        return cls(dict(fits[str(threads)]["coefficients"]), name=f"{data.get('name', Path(path).stem)}-{threads}t")


def fit(shapes: list[StepShape], times_s: list[float]) -> dict[str, float]:
    """Least squares with every coefficient >= 0 (active set: drop the most negative, refit), relative
    residuals (each step weighted by 1/t, so 50 ms decode steps count as much as 2 s prompts)."""
    import numpy as np

    names = feature_names()
    x = np.array([features(s) for s in shapes], dtype=float)
    y = np.array(times_s, dtype=float)
    w = 1.0 / y
    active = list(range(len(names)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        neg = [i for i, c in zip(active, coef) if c < 0]
        if not neg:
            break
        worst = min(neg, key=lambda i: coef[active.index(i)])
        active.remove(worst)
    out = {n: 0.0 for n in names}
    for i, c in zip(active, coef):
        out[names[i]] = float(c)
    return out


# ---- the GPU roofline -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuSpec:
    name: str = "H100 SXM 80GB"
    peak_flops: float = 989e12  # dense bf16 tensor-core FLOP/s (NVIDIA datasheet)
    mfu: float = 0.5  # fraction reached by prefill GEMMs (assumed)
    hbm_bytes_per_s: float = 3.35e12  # HBM3 (datasheet)
    hbm_efficiency: float = 0.7  # fraction of HBM bandwidth a decode step streams at (assumed)
    memory_bytes: float = 80e9
    memory_utilization: float = 0.9  # as vLLM's gpu_memory_utilization default
    activation_reserve_bytes: float = 4e9  # activations, CUDA context, workspace (assumed)
    step_overhead_s: float = 1e-3  # scheduler + launch per step (assumed)


@dataclass(frozen=True)
class ModelSpec:
    name: str = "Llama-3.1-8B (bf16)"
    num_params: float = 8.03e9
    num_layers: int = 32
    hidden_size: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 128256
    bytes_per_param: int = 2
    max_model_len: int = 131072
    kv_cache_dtype: str = "auto"  # "auto": KV values in bytes_per_param; "int8" / "fp8_*": 1 byte + an fp32 scale
                                  # per token and KV head (engine/kv/cache_dtype.py's page layout)

    @property
    def matmul_params(self) -> float:
        """Weights every token multiplies through: all but the input embedding and the lm_head."""
        return self.num_params - 2 * self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        if self.kv_cache_dtype == "auto":
            return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.bytes_per_param
        return self.num_layers * 2 * self.num_kv_heads * (self.head_dim + 4)


@dataclass(frozen=True)
class RooflineStepModel:
    gpu: GpuSpec = GpuSpec()
    model: ModelSpec = ModelSpec()
    name: str = "roofline"

    def flops(self, s: StepShape) -> float:
        m = self.model
        attn = 4 * m.num_layers * m.num_heads * m.head_dim * (s.prefill_attn_pairs + s.decode_ctx_tokens)
        return 2 * m.matmul_params * s.num_tokens + attn + 2 * m.hidden_size * m.vocab_size * s.num_sampled

    def bytes(self, s: StepShape) -> float:
        m = self.model
        kv = m.kv_bytes_per_token * (s.decode_ctx_tokens + s.prefill_ctx_tokens + s.num_tokens)
        return m.weight_bytes + kv

    def step_time_s(self, shape: StepShape) -> float:
        g = self.gpu
        compute = self.flops(shape) / (g.mfu * g.peak_flops)
        memory = self.bytes(shape) / (g.hbm_efficiency * g.hbm_bytes_per_s)
        return g.step_overhead_s + max(compute, memory)

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks one GPU holds: (memory · utilization − weights − reserve) / block bytes."""
        g = self.gpu
        free = g.memory_bytes * g.memory_utilization - self.model.weight_bytes - g.activation_reserve_bytes
        return int(free // (self.model.kv_bytes_per_token * block_size))

    def describe(self) -> dict:
        return {"kind": "roofline", "gpu": asdict(self.gpu), "model": asdict(self.model),
                "form": "overhead + max(FLOPs / (mfu * peak), bytes / (hbm_efficiency * hbm_bandwidth))"}


# ---- KV transfer ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TransferModel:
    bytes_per_block: float
    bytes_per_s: float
    fixed_s: float  # per handoff: notification, bookkeeping, the decode worker's commit
    link: str = ""

    def time_s(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.fixed_s + num_blocks * self.bytes_per_block / self.bytes_per_s

    def describe(self) -> dict:
        return asdict(self)
