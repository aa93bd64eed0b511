"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE; engine/models/config_moe.py says what each reads).

The router and the arithmetic follow transformers' modeling code step for step (fp32 greedy is token-exact):
router logits in the model dtype, softmax in fp32, top-k, renormalised when the config says so, each expert a
SwiGLU MLP, its output scaled by the token's weight for it and summed over the token's experts in ascending
expert order.

Grouped, not a loop over tokens: the (token, expert) pairs are sorted by expert, each expert runs two GEMMs
over all of its tokens at once (through the kernel backend's ``linear``), and the results are scattered back.
``tokens_per_expert`` counts the routed tokens per expert since start-up (a worker's stats report them).

With a backend that has ``fused_moe`` (triton: kernels/fused_moe.py) the experts run there instead: the pairs
are sorted into padded per-expert row blocks on the device and two grouped GEMM kernels do the rest, summing
each token's k expert rows in fp32 (torch's sum over the top-k slots, not ascending expert order: equal within
fp32 rounding, the kernel module gives its tolerances). That path, the routing and the counts (``scatter_add_``:
``bincount`` reads the ids' min and max on the host on CUDA) read nothing on the host (by construction; a GPU test
in tests/kernels/test_fused_moe.py checks the kernel's part).

The per-expert loop of ``grouped_experts`` reads the group sizes on the host (one sync per layer): with it
the layers are not captured in CUDA graphs (the runner runs such a model's decode eagerly, said at start-up).
With ``fused_moe`` the decode graphs capture MoE layers like any other, and the padding rows of a graph's
bucket are not counted (``count_rows``, set by the graphs).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.kernel_backend import KernelOps
from engine.models.layers import Linear
from engine.models.tensor_parallel import TensorParallel


class Experts(nn.Module):
    """Every expert's weights as one tensor each, transformers 5's layout: ``gate_up_proj`` [E, 2I, H] (gate
    rows first), ``down_proj`` [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)
        self.inter = inter
        self.shards = [inter, inter]  # gate_up_proj's row blocks per expert (the loader's fused pieces)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, weights_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) from router logits [T, E]."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weights_fp32 else weights.to(logits.dtype)), ids


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts, ops: KernelOps,
                    counts_out: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t, one GEMM pair per expert in use."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order within a group
    counts = torch.bincount(flat, minlength=experts.gate_up_proj.shape[0])
    if counts_out is not None:
        counts_out += counts.to(counts_out.device)
    token = order // k
    xs = x.index_select(0, token)
    ys = torch.empty_like(xs)
    start = 0
    for e, end in enumerate(counts.cumsum(0).tolist()):
        if end > start:
            gate_up = ops.linear(xs[start:end], experts.gate_up_proj[e], None)
            if ops.silu_mul is not None:
                act = ops.silu_mul(gate_up)
            else:
                gate, up = gate_up.split([experts.inter, experts.inter], dim=-1)
                act = nn.functional.silu(gate) * up
            ys[start:end] = ops.linear(act, experts.down_proj[e], None)
        start = end
    scaled = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, scaled)


class SparseMoE(nn.Module):
    """Tensor parallel (engine/models/tensor_parallel.py): every expert's intermediate size split over the ranks (and
    the shared expert's), the router and the shared expert's gate replicated, one all-reduce of the summed partial
    outputs."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps, dense_mlp: type, tp: TensorParallel | None = None) -> None:
        super().__init__()
        m = cfg.moe
        self.tp = tp = tp or TensorParallel()
        self.top_k, self.renormalize, self.weights_fp32 = m.num_experts_per_tok, m.norm_topk_prob, m.router_weights_fp32
        self.gate = Linear(cfg.hidden_size, m.num_experts, False, ops)
        inter = tp.even(m.moe_intermediate_size, "the experts' intermediate size")
        self.experts = Experts(m.num_experts, cfg.hidden_size, inter.length)
        self.experts.tp_gate_up, self.experts.tp_down = [inter, inter], [inter]
        if m.shared_expert_intermediate_size:
            self.shared_expert = dense_mlp(cfg, ops, m.shared_expert_intermediate_size, tp, reduce=False)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, ops)
        self.register_buffer("tokens_per_expert", torch.zeros(m.num_experts, dtype=torch.int64), persistent=False)
        self.ops = ops
        # 1 for a real row, 0 for padding (a CUDA graph's bucket pads the batch: engine/decode_graphs.DecodeGraphs
        # sets it around each forward it captures); None: every row is real
        self.count_rows: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.weights_fp32)
        rows = torch.ones_like(ids) if self.count_rows is None else self.count_rows.unsqueeze(1).expand_as(ids)
        self.tokens_per_expert.scatter_add_(0, ids.reshape(-1), rows.reshape(-1))
        if self.ops.fused_moe is not None:
            out = self.ops.fused_moe(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj)
        else:
            out = grouped_experts(x, weights, ids, self.experts, self.ops)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce_(out)

    def linears(self) -> list[Linear]:
        """The projections outside the expert tensors (quantized / packed like any other)."""
        shared = [self.shared_expert.gate_up_proj, self.shared_expert.down_proj, self.shared_expert_gate] \
            if hasattr(self, "shared_expert") else []
        return [self.gate, *shared]
