"""The real default model in one engine: SmolLM2-135M-Instruct from its GGUF file and from the directory
transformers 5 saves, token for token against transformers (greedy; raw prompts and chats, batched)."""
from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loading.checkpoint import load_model_config, load_tokenizer
from engine.request import SamplingParams
from tests.real_model import CHATS, RAW_PROMPTS

pytestmark = pytest.mark.slow
MAX_TOKENS = 48


def test_gguf_and_transformers_5_directory_parse_to_the_same_model(smollm2_gguf, smollm2_dir):
    saved = json.loads((smollm2_dir / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_theta" not in saved  # the form that used to be misread
    from_gguf, from_dir = load_model_config(smollm2_gguf), load_model_config(smollm2_dir)
    assert from_gguf.rope_theta == from_dir.rope_theta == 100000.0
    fields = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_type",
              "tie_word_embeddings")
    assert {f: getattr(from_gguf, f) for f in fields} == {f: getattr(from_dir, f) for f in fields}
    assert (from_gguf.num_layers, from_gguf.hidden_size, from_gguf.num_heads, from_gguf.num_kv_heads) == (30, 576, 9, 3)


def test_gguf_tokenizer_equals_transformers(smollm2_gguf, smollm2_reference):
    ours, ref = load_tokenizer(smollm2_gguf), smollm2_reference.tokenizer
    texts = RAW_PROMPTS + ["In 2024 there were 12345 cats, x1y22z333 and $3.50.", "héllo wörld ñ 中文 🙂",
                           "a\n\n  b\t\tc   ", "<|im_start|>user\nhi<|im_end|>", "don't I'LL  you've", ""]
    for text in texts:
        assert ours.encode(text) == smollm2_reference.prompt_ids(text), text
        assert ours.decode(ours.encode(text)) == ref.decode(ref(text)["input_ids"], skip_special_tokens=True)
    for messages in CHATS.values():
        assert ours.encode_chat(messages) == smollm2_reference.chat_ids(messages)
    assert ours.eos_token_ids == {ref.eos_token_id} and ours.eos_token == "<|im_end|>"


@pytest.mark.parametrize("checkpoint", ["gguf", "transformers-5-dir"])
def test_greedy_equals_transformers(checkpoint, smollm2_gguf, smollm2_dir, smollm2_reference):
    path = smollm2_gguf if checkpoint == "gguf" else smollm2_dir
    engine = Engine(EngineConfig(model=str(path), num_blocks=96))
    ref = smollm2_reference
    prompts = [ref.chat_ids(m) for m in CHATS.values()] + [ref.prompt_ids(p) for p in RAW_PROMPTS]
    results = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for ids, res in zip(prompts, results):
        want = ref.greedy(ids, MAX_TOKENS)
        ours = res["token_ids"]
        assert ours[:len(ours) - (ours[-1] in engine.tokenizer.eos_token_ids)] == want  # EOS itself not compared
        assert res["text"] == ref.text(want)
    assert "Paris" in results[0]["text"]
    engine.pool.check()


def test_gguf_weights_stay_packed_in_the_files_bytes(smollm2_gguf):
    """Issue 48: the Q4_1 projections and the Q8_0 token table (the tied head) stay in their blocks: resident weight
    bytes within 1.15x of the file's quantized tensor bytes, and no dense copy beside them (the norms only)."""
    from engine.loading.gguf import open_gguf
    from kernels.quant import GGUF_BLOCKS

    model = Engine(EngineConfig(model=str(smollm2_gguf), num_blocks=16)).runner.model
    quantized = sum(int(t.n_bytes) for t in open_gguf(smollm2_gguf)._reader.tensors if t.tensor_type.name in GGUF_BLOCKS)
    packed = {id(m.quant): m.quant.num_bytes for m in model.modules() if getattr(m, "quant", None) is not None}
    assert model.embed_quant is not None and id(model.embed_quant) in packed  # the tied head is the table
    assert quantized <= sum(packed.values()) <= 1.15 * quantized
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    assert dense == (2 * model.cfg.num_layers + 1) * model.cfg.hidden_size * 4  # the RMSNorm weights, fp32
