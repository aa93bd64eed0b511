"""The Llama family (Llama 2/3, Qwen2, Qwen3, Mistral) as one readable torch model over a paged KV cache.

Differences between the family members are configuration, not code: Qwen2 has q/k/v biases and usually
tied embeddings, Qwen3 normalises each head of q and k (RMSNorm over the head's dims) before RoPE, Llama may have biases on every projection (``attention_bias``, ``mlp_bias``), Mistral and
Qwen2 may use a sliding window (Qwen2 on some layers only), Llama 3 scales RoPE. q/k/v and gate/up projections are
fused into one GEMM each at load time (``stacked_params``).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.layers import Linear, RMSNorm, RotaryEmbedding
from engine.ops import KernelOps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, ops)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, ops)
        self.scale = self.head_dim ** -0.5
        self.sliding_window = sliding_window
        self.ops = ops
        if cfg.qk_norm:  # torch's arithmetic (the fused norm kernels take whole rows of the hidden size)
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, positions, rope, key_cache, value_cache, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):  # written back into qkv: the fused RoPE below works on it in place
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
            q.copy_(self.q_norm(q))
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
            k.copy_(self.k_norm(k))
        if self.ops.rotary_ is not None:  # in place on the q and k heads at the front of each row (q, k are views)
            self.ops.rotary_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, positions, rope.cos, rope.sin)
        else:
            q, k = rope(positions, q, k)
        o = paged_attention(self.ops, q, k, v, key_cache, value_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, cfg.mlp_bias, ops)
        self.down_proj = Linear(self.inter, cfg.hidden_size, cfg.mlp_bias, ops)
        self.silu_mul = ops.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu_mul is not None:
            return self.down_proj(self.silu_mul(gate_up))
        gate, up = gate_up.split([self.inter, self.inter], dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, ops, cfg.layer_sliding_window(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops)

    def forward(self, x, residual, positions, rope, key_cache, value_cache, meta):
        """x: the previous layer's MLP output (the embeddings for layer 0, residual None); residual: the stream
        before it. Returns (this layer's MLP output, the stream before it): the add of one layer happens in the
        next one's input norm (fused there), the last one in the final norm."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, key_cache, value_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    # HF checkpoint name fragment -> (our fused parameter fragment, shard index)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, cfg: ModelConfig, ops: KernelOps, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, ops)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg, max_positions)

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [num_blocks, num_layers, 2, B, Hkv, D] → hidden [T, hidden]."""
        h, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, positions, self.rope, kv_cache[:, i, 0], kv_cache[:, i, 1], meta)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def shard_sizes(self, fused_name: str) -> list[int]:
        a = self.layers[0].self_attn
        if ".qkv_proj." in fused_name:
            return [a.q_size, a.kv_size, a.kv_size]
        return [self.cfg.intermediate_size] * 2

    def checkpoint_to_param(self, hf_name: str) -> tuple[str, int | None] | None:
        """Our parameter name (and shard index for a fused one) for a checkpoint tensor; None = ignore."""
        if "rotary_emb.inv_freq" in hf_name:
            return None
        name = hf_name.removeprefix("model.")
        if self.cfg.tie_word_embeddings and name == "lm_head.weight":
            return None  # tied: the embedding is the head (some checkpoints store both)
        for frag, (fused, shard) in self.stacked_params.items():
            if frag in name:
                return name.replace(frag, fused), shard
        return name, None

    def quantize_int8(self, group_size: int | None = None) -> None:
        """w8a16: int8 weights for every projection (embedding and lm_head stay in float)."""
        for layer in self.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.quantize_int8(group_size)

    def pack_linears(self) -> None:
        """Every projection and the LM head into the backend's packed GEMM layout (``KernelOps.pack_linear``).
        A tied LM head keeps the dense table too (the embedding lookup reads it)."""
        for layer in self.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.pack()
        self.lm_head.pack(keep_dense=self.cfg.tie_word_embeddings)

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.state_dict(keep_vars=False).items()
