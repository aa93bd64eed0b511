"""The CPU path's C kernels (kernels/cpu_native.py) against the torch references, and the engine with them.

Attention is checked through the strided layer views of a real 6-D cache with scattered block tables, ragged
lengths, GQA groups of 1, 2, 3, 4, 6 and 8, head dims with and without the 8-wide vector path, sliding windows,
decode with a task per sequence and per KV head, and prefills that continue a cached prefix or run past the
kernel's 64-token chunks and 256-key tiles, with block sizes that do and do not line up with the tiles.
Tolerances are the fp32 ones of the other kernel tests (tests/kernels/paged.py): reordered fp32 sums, while a
wrong mask, block or head mapping gives errors of order 1e-1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_native
from kernels.decode_attention import paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention_ref
from tests.kernels.paged import assert_close, block_tables, kv_cache, layer_views, lens_tensor

# (head_dim, q_heads, kv_heads): GQA groups of 1, 2, 3, 4, 6 (one chunk of 4 query heads and one of 2) and 8; head
# dims on the C kernels' 32-column tiles (64, 128), with an 8-column tail (80), and off the vector path (20)
HEADS = [(64, 9, 3), (64, 4, 4), (80, 8, 2), (20, 4, 1), (128, 8, 2), (32, 4, 2), (64, 12, 2), (16, 8, 1)]



def _cache(head_dim, kv_heads, block_size, seq_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(seq_lens) * (max(seq_lens) // block_size + 2)
    cache = kv_cache(num_blocks, block_size, kv_heads, head_dim, torch.float32, gen).cpu()
    key_cache, value_cache = layer_views(cache)
    return gen, key_cache, value_cache, block_tables(seq_lens, block_size, num_blocks, gen).cpu()


@pytest.mark.parametrize("head_dim,q_heads,kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [4, 16, 32])  # 4: the old kernel's scalar softmax path (head dim 20)
@pytest.mark.parametrize("window", [None, 5, 40])
# on 2 threads: 6 sequences -> a task per sequence; 1 -> a task per KV head (fewer sequences than 2x the threads)
@pytest.mark.parametrize("num_seqs", [1, 6])
def test_decode_attention_matches_reference(head_dim, q_heads, kv_heads, block_size, window, num_seqs, two_threads):
    seq_lens = [1, 7, 33, 100, 16, 257] if num_seqs == 6 else [95]
    gen, key_cache, value_cache, tables = _cache(head_dim, kv_heads, block_size, seq_lens, seed=head_dim + block_size)
    # q as the model passes it: a strided view into a fused projection's output
    qkv = torch.randn(len(seq_lens), (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : q_heads * head_dim].reshape(len(seq_lens), q_heads, head_dim)
    assert num_seqs == 1 or not q.is_contiguous()
    lens = lens_tensor(seq_lens).cpu()
    out = cpu_native.paged_decode_attention(q, key_cache, value_cache, tables, lens, head_dim ** -0.5, window)
    ref = paged_decode_attention_ref(q, key_cache, value_cache, tables, lens, head_dim ** -0.5, window)
    assert_close(out, ref)


@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 9, 3), (128, 8, 2), (32, 4, 4)])
@pytest.mark.parametrize("seq_lens,threads", [([700], 2), ([600, 20], 4), ([1000, 129, 300], 4)])
@pytest.mark.parametrize("window", [None, 300])
def test_decode_attention_splits_long_keys_when_tasks_are_few(head_dim, q_heads, kv_heads, seq_lens, threads,
                                                               window):
    """Fewer (sequence, KV head) tasks than twice the threads: each splits its keys into chunks of >= 128 and
    the chunks' outputs are merged (a short sequence beside long ones has empty chunks)."""
    gen, key_cache, value_cache, tables = _cache(head_dim, kv_heads, 16, seq_lens, seed=head_dim + len(seq_lens))
    q = torch.randn(len(seq_lens), q_heads, head_dim, generator=gen)
    lens = lens_tensor(seq_lens).cpu()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_native.paged_decode_attention(q, key_cache, value_cache, tables, lens, head_dim ** -0.5, window)
    finally:
        torch.set_num_threads(old)
    assert_close(out, paged_decode_attention_ref(q, key_cache, value_cache, tables, lens, head_dim ** -0.5, window))


def test_decode_attention_large_scratch():
    """64 query heads x 128-token blocks: the per-sequence scratch no longer fits the stack buffer (heap)."""
    seq_lens = [3, 300, 129]
    gen, key_cache, value_cache, tables = _cache(16, 8, 128, seq_lens, seed=7)
    q = torch.randn(len(seq_lens), 64, 16, generator=gen)
    lens = lens_tensor(seq_lens).cpu()
    assert_close(cpu_native.paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.25),
                 paged_decode_attention_ref(q, key_cache, value_cache, tables, lens, 0.25))


@pytest.mark.parametrize("head_dim,q_heads,kv_heads", HEADS)
@pytest.mark.parametrize("window", [None, 3, 50])
@pytest.mark.parametrize("block_size", [16, 5])  # 5: tiles and chunks that do not line up with blocks
def test_prefill_attention_matches_reference(head_dim, q_heads, kv_heads, window, block_size):
    # (new tokens, context incl. them): fresh prompts, continuations of a cached prefix, prompts past several
    # 64-token chunks and 256-key tiles
    shapes = [(5, 5), (1, 9), (40, 100), (300, 300), (130, 260), (17, 17), (70, 600)]
    q_lens, seq_lens = [a for a, _ in shapes], [b for _, b in shapes]
    gen, key_cache, value_cache, tables = _cache(head_dim, kv_heads, block_size, seq_lens, seed=head_dim)
    # q as the model passes it: a strided view into a fused projection's output
    qkv = torch.randn(sum(q_lens), (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : q_heads * head_dim].reshape(sum(q_lens), q_heads, head_dim)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = lens_tensor(seq_lens).cpu()
    out = cpu_native.prefill_attention(q, key_cache, value_cache, tables, cu, lens, head_dim ** -0.5, window)
    ref = prefill_attention_ref(q, key_cache, value_cache, tables, cu, lens, head_dim ** -0.5, window)
    assert_close(out, ref)


def test_attention_rejects_bad_tables_and_lengths():
    gen, key_cache, value_cache, tables = _cache(64, 2, 16, [20, 30], seed=1)
    q = torch.randn(2, 4, 64)
    lens = torch.tensor([20, 30], dtype=torch.int32)
    bad = tables.clone()
    bad[1, 0] = key_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="outside"):
        cpu_native.paged_decode_attention(q, key_cache, value_cache, bad, lens, 0.125)
    with pytest.raises(ValueError, match="seq_lens"):
        cpu_native.paged_decode_attention(q, key_cache, value_cache, tables,
                                          torch.tensor([20, 16 * tables.shape[1] + 1], dtype=torch.int32), 0.125)
    with pytest.raises(TypeError, match="float32"):
        cpu_native.paged_decode_attention(q.half(), key_cache, value_cache, tables, lens, 0.125)
    cu = torch.tensor([0, 25, 30], dtype=torch.int32)  # 25 new tokens in a context of 20
    with pytest.raises(ValueError, match="new tokens"):
        cpu_native.prefill_attention(torch.randn(30, 4, 64), key_cache, value_cache, tables, cu, lens, 0.125)


def test_fused_token_ops_match_the_torch_layers():
    from engine.models.config import ModelConfig
    from engine.models.layers import RMSNorm, RotaryEmbedding

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576, generator=gen) + 0.5
    x = torch.randn(37, 576, generator=gen) * 3
    res = torch.randn(37, 576, generator=gen)
    torch.testing.assert_close(cpu_native.rms_norm(x, norm.weight, 1e-5), norm(x), atol=1e-6, rtol=1e-6)
    ref_out, ref_res = norm(x, res)
    res_c = res.clone()
    out = cpu_native.rms_norm(x, norm.weight, 1e-5, res_c)  # updates res_c in place
    torch.testing.assert_close(res_c, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)

    cfg = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 1,
                                 "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 64,
                                 "vocab_size": 100, "max_position_embeddings": 4096, "rope_theta": 100000.0,
                                 "rms_norm_eps": 1e-5})
    rope = RotaryEmbedding(cfg, 4096)
    positions = torch.randint(0, 4096, (37,), generator=gen)
    qkv = torch.randn(37, 15 * 64, generator=gen)
    q_ref, k_ref = rope(positions, qkv[:, :576].reshape(37, 9, 64), qkv[:, 576:768].reshape(37, 3, 64))
    v_before = qkv[:, 768:].clone()
    cpu_native.rotary_(qkv, 12, 64, positions, rope.cos, rope.sin)
    torch.testing.assert_close(qkv[:, :576].reshape(37, 9, 64), q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(qkv[:, 576:768].reshape(37, 3, 64), k_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 768:], v_before)  # v is not a rotated head
    with pytest.raises(ValueError, match="positions"):
        cpu_native.rotary_(qkv, 12, 64, torch.full((37,), 4096), rope.cos, rope.sin)

    gate_up = torch.randn(37, 2 * 1535, generator=gen) * 4  # 1535: the scalar tail after the vector lanes too
    # where exp under- and overflows, and non-finite gates: the C kernel's own vectorized exp must agree
    gate_up[0, :14] = torch.tensor([-200.0, -100, -88.5, -87.5, -87, -50, -1e-3, 0, 1e-3, 88, 89, 200,
                                    float("inf"), float("nan")])
    gate_up[1, 1532:1535] = torch.tensor([-150.0, float("-inf"), 95])  # in the scalar tail
    ref = torch.nn.functional.silu(gate_up[:, :1535]) * gate_up[:, 1535:]
    torch.testing.assert_close(cpu_native.silu_mul(gate_up), ref, atol=1e-6, rtol=2e-6, equal_nan=True)


def test_embedding_is_torchs_lookup_and_refuses_ids_outside_the_table():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(300, 1000, generator=gen)[:, :576]  # rows strided: a view of a wider table
    for ids in (torch.tensor([5]), torch.randint(0, 300, (130,), generator=gen), torch.tensor([], dtype=torch.int64)):
        assert torch.equal(cpu_native.embedding(table, ids), torch.nn.functional.embedding(ids, table))
    for bad in (300, -1):
        with pytest.raises(IndexError, match=r"token ids must be in \[0, 300\)"):
            cpu_native.embedding(table, torch.tensor([3, bad]))


@pytest.mark.parametrize("head_dim,factor", [(128, 0.75), (16, 0.75), (64, 0.25)])  # Phi-4-mini: 96 of 128
def test_partial_rotary_turns_the_front_of_each_head_only(head_dim, factor):
    """The C rotary with rotary_dim < head_dim: the first rotary_dim dims of each q/k head as the torch layer
    rotates them (transformers' Phi-3 arithmetic), the rest of each head and the v heads untouched."""
    from engine.models.config import ModelConfig
    from engine.models.layers import RotaryEmbedding

    cfg = ModelConfig(architecture="Phi3ForCausalLM", vocab_size=64, hidden_size=8 * head_dim, num_layers=1,
                      num_heads=8, num_kv_heads=2, head_dim=head_dim, intermediate_size=8,
                      max_position_embeddings=4096, partial_rotary_factor=factor)
    rope, rot, t = RotaryEmbedding(cfg, 4096), cfg.rotary_dim, 19
    assert rot == int(head_dim * factor) < head_dim and rope.cos.shape == (4096, rot)
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 4096, (t,), generator=gen)
    qkv = torch.randn(t, 12 * head_dim, generator=gen)
    before = qkv.clone()
    heads = before[:, : 10 * head_dim].reshape(t, 10, head_dim)
    want = torch.cat(rope(positions, heads[:, :8], heads[:, 8:]), dim=1)
    cpu_native.rotary_(qkv, 10, head_dim, positions, rope.cos, rope.sin, rotary_dim=rot)
    got = qkv[:, : 10 * head_dim].reshape(t, 10, head_dim)
    torch.testing.assert_close(got[..., :rot], want[..., :rot], atol=1e-6, rtol=1e-6)
    assert torch.equal(got[..., rot:], heads[..., rot:]) and torch.equal(want[..., rot:], heads[..., rot:])
    assert torch.equal(qkv[:, 10 * head_dim:], before[:, 10 * head_dim:])  # v is not a rotated head
    with pytest.raises(ValueError, match=rf"\[max_positions, {head_dim}\] table"):  # a partial table, no rotary_dim
        cpu_native.rotary_(qkv, 10, head_dim, positions, rope.cos, rope.sin)
    with pytest.raises(ValueError, match=f"rotary_dim {head_dim + 2} must be even and in"):
        cpu_native.rotary_(qkv, 10, head_dim, positions, rope.cos, rope.sin, rotary_dim=head_dim + 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases and a tied LM head
def test_engine_cpu_backend_same_greedy_tokens_as_torch(tiny_model, arch):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    model_dir = tiny_model(arch)
    prompts = [[5, 6, 7], list(range(10, 43)), list(range(60, 80)) * 3]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(kernels):
        e = Engine(EngineConfig(model=str(model_dir), num_blocks=64, kernels=kernels, max_num_batched_tokens=32))
        return e, [r["token_ids"] for r in e.generate(prompts, params)]

    cpu_engine, cpu_tokens = run("auto")
    assert cpu_engine.runner.ops.name == "cpu" and cpu_engine.stats.kernel_fallbacks == 0
    torch_engine, torch_tokens = run("torch")
    assert torch_engine.runner.ops.name == "torch"
    assert cpu_tokens == torch_tokens
    # the projections were packed for oneDNN and their dense copies dropped; the tied head keeps the table
    model = cpu_engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.packed is not None
    tied = model.cfg.tie_word_embeddings
    assert tied == (arch == "qwen2")
    assert model.lm_head.packed is not None
    assert model.lm_head.weight is (model.embed_tokens.weight if tied else None)
    from tests.engine.models.test_kernel_backends import prompt_logits

    a = prompt_logits(cpu_engine, prompts[2])
    b = prompt_logits(torch_engine, prompts[2])
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()


_FALLBACK_SCRIPT = """
import json, sys
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError
e = Engine(EngineConfig(model=sys.argv[1], num_blocks=16))
try:
    Engine(EngineConfig(model=sys.argv[1], num_blocks=16, kernels="cpu"))
    named = "accepted"
except ConfigError as err:
    named = str(err)
print(json.dumps({"backend": e.runner.backend, "fallbacks": e.stats.kernel_fallbacks,
                  "reason": e.runner.kernel_fallback, "named": named}))
"""


def test_no_compiler_falls_back_to_torch_loudly(tiny_model, tmp_path):
    """A machine without a C compiler: ``auto`` runs the torch references, logs why and counts it; asking for
    ``cpu`` by name is a ConfigError. A fresh process, an empty kernel cache and CC naming a failing program."""
    env = {**os.environ, "CC": "false", "DUET_CACHE_DIR": str(tmp_path), "DUET_KERNELS": ""}
    proc = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT, str(tiny_model("llama"))], env=env,
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["backend"] == "torch" and got["fallbacks"] == 1
    assert "NativeKernelError" in got["reason"]
    assert "cpu kernel backend is unavailable" in got["named"]
    assert "C attention kernels are unavailable" in proc.stderr  # the warning in the log


def test_store_kv_matches_reference():
    from kernels.store_kv import store_kv_ref

    gen = torch.Generator().manual_seed(3)
    cache_a = kv_cache(12, 16, 3, 64, torch.float32, gen).cpu()
    cache_b = cache_a.clone()
    qkv = torch.randn(40, 15 * 64, generator=gen)  # k and v as the model passes them: views of the fused output
    k = qkv[:, 576:768].reshape(40, 3, 64)
    v = qkv[:, 768:].reshape(40, 3, 64)
    slots = torch.randperm(12 * 16, generator=gen)[:40]
    slots[[3, 17]] = -1  # padding tokens: not written
    store_kv_ref(k, v, *layer_views(cache_a), slots)
    cpu_native.store_kv(k, v, *layer_views(cache_b), slots)
    assert torch.equal(cache_a, cache_b)
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu_native.store_kv(k, v, *layer_views(cache_b), torch.full((40,), 12 * 16))


def test_validation_sees_tables_changed_in_place():
    """Every call checks the tables and lengths it is given (the C kernels trust them)."""
    gen, key_cache, value_cache, tables = _cache(64, 2, 16, [20, 30], seed=2)
    q = torch.randn(2, 4, 64)
    lens = torch.tensor([20, 30], dtype=torch.int32)
    cpu_native.paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.125)  # valid: remembered
    tables[1, 0] = key_cache.shape[0] + 5
    with pytest.raises(ValueError, match="outside"):
        cpu_native.paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.125)
    lens[0] = 10_000
    with pytest.raises(ValueError, match="seq_lens"):
        cpu_native.paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.125)


@pytest.mark.parametrize("m", [1, 7, 64, 65, 130, 256, 300])  # exact row counts, then padded to 128s
def test_packed_linear_matches_dense(m):
    if not cpu_native.onednn_available():
        pytest.fail("this torch build has no oneDNN: the CPU path's GEMMs need it")
    gen = torch.Generator().manual_seed(m)
    w, b = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(m, 80, generator=gen)
    packed = cpu_native.pack_linear(w)
    out = cpu_native.linear_packed(x, packed, b)
    assert out.shape == (m, 96)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu_native.linear_packed(x, packed), x @ w.T, atol=1e-4, rtol=1e-5)
