"""The Llama family (Llama 2/3, Qwen2, Qwen3, Mistral) as one readable torch model over a paged KV cache.

Differences between the family members are configuration, not code: Qwen2 has q/k/v biases and usually
tied embeddings, Qwen3 normalises each head of q and k (RMSNorm over the head's dims) before RoPE, Llama may have biases
on every projection (``attention_bias``, ``mlp_bias``), Mistral and Qwen2 may use a sliding window (Qwen2 on some layers
only), Llama 3 and Phi-3 scale RoPE, Phi-4-mini rotates only the front of each head (``partial_rotary_factor``,
engine/models/layers.py). Mixtral, Qwen2-MoE and Qwen3-MoE replace the MLP of their sparse layers with experts
(engine/models/moe.py). q/k/v and gate/up projections are fused into one GEMM each at load time (``stacked_params``),
each expert's gate/up into its block of one [E, 2I, H] tensor.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from engine.models.attention import AttentionMetadata, paged_attention
from engine.models.config import ModelConfig
from engine.models.kernel_backend import KernelOps
from engine.models.layers import Linear, RMSNorm, RotaryEmbedding
from engine.models.moe import Experts, SparseMoE
from engine.models.tensor_parallel import TensorParallel, narrow_parts
from kernels.kv_quant import LayerKV

log = logging.getLogger(__name__)
# one expert's projection in a checkpoint (Qwen: gate/up/down_proj; Mixtral: w1/w3/w2, under block_sparse_moe)
_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_ALL_EXPERTS = re.compile(r"(layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PART = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, sliding_window: int | None, tp: TensorParallel) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        q_rows, kv_rows = tp.heads(cfg.num_heads, cfg.num_kv_heads, self.head_dim)  # this rank's heads
        self.q_size, self.kv_size = q_rows.length, kv_rows.length
        self.num_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, ops)
        self.qkv_proj.shards = [self.q_size, self.kv_size, self.kv_size]
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, ops)
        if tp.enabled:
            self.qkv_proj.tp_split = (0, [q_rows, kv_rows, kv_rows])
            self.o_proj.tp_split, self.o_proj.reduce = (1, [q_rows]), tp
        self.scale = (cfg.gemma.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = cfg.gemma.attn_logit_softcapping
        self.sliding_window = sliding_window
        self.ops = ops
        if cfg.qk_norm:  # torch's arithmetic (the fused norm kernels take whole rows of the hidden size)
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, positions, rope, kv: LayerKV, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):  # q and k are views of qkv: written back, the fused RoPE below works in place
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if self.ops.rotary_ is not None:  # in place on the q and k heads at the front of each row (q, k are views)
            self.ops.rotary_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, positions, rope.cos, rope.sin,
                             rotary_dim=rope.rotary_dim)
        else:
            q, k = rope(positions, q, k)
        o = paged_attention(self.ops, q, k, v, kv, meta, self.scale, self.sliding_window, self.softcap)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """``reduce=False``: a tensor-parallel block's output stays a partial sum (Qwen2-MoE's shared expert: the MoE
    layer reduces once for it and the experts)."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps, intermediate_size: int | None = None,
                 tp: TensorParallel | None = None, reduce: bool = True) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        inter = tp.even(intermediate_size or cfg.intermediate_size, "the MLP's intermediate size")
        self.inter = inter.length
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, cfg.mlp_bias, ops)
        self.gate_up_proj.shards = [self.inter, self.inter]
        self.down_proj = Linear(self.inter, cfg.hidden_size, cfg.mlp_bias, ops)
        if tp.enabled:
            self.gate_up_proj.tp_split = (0, [inter, inter])
            self.down_proj.tp_split, self.down_proj.reduce = (1, [inter]), (tp if reduce else None)
        self.gelu_tanh = cfg.gemma.gelu_tanh  # Gemma's GeGLU (no fused kernel: torch's arithmetic)
        self.silu_mul = None if self.gelu_tanh else ops.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu_mul is not None:
            return self.down_proj(self.silu_mul(gate_up))
        gate, up = gate_up.split([self.inter, self.inter], dim=-1)
        act = nn.functional.gelu(gate, approximate="tanh") if self.gelu_tanh else nn.functional.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, index: int, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, ops, cfg.layer_sliding_window(index), tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = SparseMoE(cfg, ops, MLP, tp) if index in cfg.moe.sparse_layers else MLP(cfg, ops, tp=tp)

    def linears(self) -> list[Linear]:
        mlp = self.mlp.linears() if isinstance(self.mlp, SparseMoE) else [self.mlp.gate_up_proj, self.mlp.down_proj]
        return [self.self_attn.qkv_proj, self.self_attn.o_proj, *mlp]

    def forward(self, x, residual, positions, rope, kv: LayerKV, meta):
        """x: the previous layer's MLP output (the embeddings for layer 0, residual None); residual: the stream
        before it. Returns (this layer's MLP output, the stream before it): the add of one layer happens in the
        next one's input norm (fused there), the last one in the final norm."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, kv, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2's layer: a norm after attention and around the MLP too; the residual is added after each post-norm.
    Same protocol as ``DecoderLayer`` (returns the last branch's output and the stream before it; the next
    layer's input norm adds them)."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps, index: int, tp: TensorParallel) -> None:
        super().__init__(cfg, ops, index, tp)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, x, residual, positions, rope, kv: LayerKV, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, rope, kv, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class CausalLM(nn.Module):
    # HF checkpoint name fragment -> (our fused parameter fragment, shard index)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, cfg: ModelConfig, ops: KernelOps, max_positions: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.tp = tp = tp or TensorParallel()
        vocab = tp.vocab(cfg.vocab_size)  # this rank's rows of the embedding and the LM head
        self.embed_tokens = nn.Embedding(vocab.length, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        layer = SandwichDecoderLayer if cfg.gemma.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer(cfg, ops, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = Linear(cfg.hidden_size, vocab.length, False, ops)
        if tp.enabled:
            self.embed_tokens.tp_split = self.lm_head.tp_split = (0, [vocab])
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.embed_quant = None  # the token table kept quantized (engine/loading/quantized.py); else the dense one
        self.rope = RotaryEmbedding(cfg, max_positions)
        # Gemma 3: the sliding layers' own RoPE (None: every layer uses ``rope``)
        self.rope_local = RotaryEmbedding(cfg.local_rope_config(), max_positions) if cfg.rope_local else None

    def forward(self, input_ids, positions, kv_layers: Sequence[LayerKV], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_layers: each layer's views of the KV cache (kernels/kv_quant.py
        ``layer_views``) → hidden [T, hidden]."""
        if self.embed_quant is not None:  # a quantized token table kept packed: its rows dequantized
            h, residual = self.ops.quant_rows(self.embed_quant, input_ids), None
        elif self.ops.embedding is not None and not self.tp.enabled:  # a float table, whole on this rank
            h, residual = self.ops.embedding(self.embed_tokens.weight, input_ids), None
        else:
            h, residual = self.tp.embed(self.embed_tokens.weight, input_ids, self.cfg.vocab_size), None
        if self.cfg.gemma.embed_scale:  # Gemma: sqrt(hidden), rounded to the model dtype first (as transformers)
            h = h * float(torch.tensor(self.cfg.hidden_size ** 0.5, dtype=h.dtype))
        for i, layer in enumerate(self.layers):
            rope = self.rope_local if self.rope_local is not None and layer.self_attn.sliding_window else self.rope
            h, residual = layer(h, residual, positions, rope, kv_layers[i], meta)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_vocab(self.lm_head(hidden), self.cfg.vocab_size)
        cap = self.cfg.gemma.final_logit_softcapping
        if cap is not None:  # Gemma 2, in the model dtype as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def shard_sizes(self, fused_name: str) -> list[int]:
        """The row blocks of a fused parameter (q/k/v, gate/up, an expert's gate/up)."""
        return self.get_submodule(fused_name.rsplit(".", 1)[0]).shards

    def checkpoint_to_param(self, hf_name: str) -> tuple[str, object] | None:
        """Our parameter name and the piece of it a checkpoint tensor fills (``param_piece``); None = ignore."""
        if "rotary_emb.inv_freq" in hf_name:
            return None
        name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        if self.cfg.tie_word_embeddings and name == "lm_head.weight":
            return None  # tied: the embedding is the head (some checkpoints store both)
        m = _EXPERT.fullmatch(name)
        if m:
            part, shard = _EXPERT_PART[m.group(3)]
            return f"{m.group(1)}.{part}", (int(m.group(2)), shard)
        m = _ALL_EXPERTS.fullmatch(name)  # one projection of every expert in one tensor (GGUF)
        if m:
            part, shard = _EXPERT_PART[m.group(2)]
            return f"{m.group(1)}.{part}", None if shard is None else (None, shard)
        for frag, (fused, shard) in self.stacked_params.items():
            if frag in name:
                return name.replace(frag, fused), shard
        return name, None

    def param_piece(self, name: str, param: torch.Tensor, piece) -> torch.Tensor:
        """The view a checkpoint tensor fills: the whole (None), shard s of a fused one (s), expert e's slice of
        an expert tensor, whole or its shard s ((e, None) / (e, s)), or shard s of every expert ((None, s))."""
        if piece is None:
            return param
        if isinstance(piece, tuple) and piece[0] is None:
            sizes = self.shard_sizes(name)
            return param.narrow(1, sum(sizes[:piece[1]]), sizes[piece[1]])
        expert, shard = piece if isinstance(piece, tuple) else (None, piece)
        t = param if expert is None else param[expert]
        if shard is None:
            return t
        sizes = self.shard_sizes(name)
        return t.narrow(0, sum(sizes[:shard]), sizes[shard])

    def tp_narrow(self, name: str, piece, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor that fills ``piece`` of parameter ``name`` (itself, without
        tensor parallelism or for a replicated parameter)."""
        if not self.tp.enabled:
            return tensor
        owner, attr = name.rsplit(".", 1)
        module = self.get_submodule(owner)
        if isinstance(module, Experts):  # [E, 2I, H] / [E, H, I], or one expert's [2I, H] / [I, H] / [H, I]
            split = module.tp_gate_up if attr == "gate_up_proj" else module.tp_down
            whole = piece is None or (isinstance(piece, tuple) and piece[0] is None)
            dim = (1 if attr == "gate_up_proj" else 2) - (0 if whole else 1)
            shard = piece[1] if isinstance(piece, tuple) else None
            return narrow_parts(tensor, dim, split if shard is None else [split[shard]])
        spec = getattr(module, "tp_split", None)
        if spec is None:
            return tensor
        dim, splits = spec
        if attr == "bias" and dim == 1:
            return tensor  # a row-parallel bias is added whole, after the all-reduce
        return narrow_parts(tensor, dim if attr != "bias" else 0, splits if piece is None else [splits[piece]])

    def covered(self, name: str, piece) -> set:
        """The pieces (``pieces``) that loading ``piece`` fills."""
        if isinstance(piece, tuple) and piece[0] is None:
            return {(e, piece[1]) for e in range(self.get_submodule(name.rsplit(".", 1)[0]).gate_up_proj.shape[0])}
        return {piece}

    def pieces(self, name: str) -> set:
        """The pieces that together fill a parameter (a checkpoint may also give it whole: None)."""
        module = self.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, Experts):
            n = module.gate_up_proj.shape[0]
            return {(e, s) for e in range(n) for s in ((0, 1) if name.endswith("gate_up_proj") else (None,))}
        shards = getattr(module, "shards", None)
        return set(range(len(shards))) if shards else {None}

    def _linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in layer.linears()]

    def quantize_int8(self, group_size: int | None = None) -> None:
        """w8a16: int8 weights for every projection (embedding and lm_head stay in float)."""
        if self.cfg.moe.num_experts:
            log.warning("w8a16: the experts' weights stay in float (int8 covers attention, routers, shared experts)")
        for lin in self._linears():
            lin.quantize_int8(group_size)

    def pack_linears(self) -> None:
        """Every projection and the LM head into the backend's packed GEMM layout (``KernelOps.pack_linear``).
        A tied LM head keeps the dense table too (the embedding lookup reads it). Expert tensors stay dense."""
        for lin in self._linears():
            lin.pack()
        self.lm_head.pack(keep_dense=self.cfg.tie_word_embeddings and self.embed_quant is None)

    def reset_counters(self) -> None:
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.tokens_per_expert.zero_()

    def tokens_per_expert(self) -> list[int]:
        """Routed tokens per expert since start-up, summed over the sparse layers ([] for a dense model)."""
        counts = [layer.mlp.tokens_per_expert for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        return torch.stack(counts).sum(0).tolist() if counts else []

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.state_dict(keep_vars=False).items()
