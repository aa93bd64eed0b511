"""Issue 26, must-show 2, served: a tiny llama-architecture GGUF whose vocabulary is SentencePiece (trained here,
written as llama.cpp writes one: scores, <0xNN> byte tokens, no merges; tests/engine/loading/test_gguf_spm.py) through
`duet serve` — 1 prefill + 1 decode Ray actor, every prompt's KV pulled over NIXL — greedy, token for token with
transformers loading the same file (its tokenizer and its model): raw completions (one through byte fallback)
and chat with the file's own chat template, through the official openai client.

The served text of a completion continues the prompt's text (the decoder's leading "▁" of the first generated
word is a space, as vLLM streams it), so the reference is transformers' decode of prompt + continuation minus
its decode of the prompt. Greedy never picks a byte token here (their rows of lm_head are zero): a random model's
stray bytes are not UTF-8, and such text has no one right streamed spelling (the engine test compares those ids).
"""
from __future__ import annotations

import signal
import sys

import openai
import pytest
from safetensors.numpy import load_file, save_file

from engine.loading.tiny import make_tiny_model
from tests.cluster.serve_process import serve_worker_stats, serving
from tests.engine.loading.gguf_files import write_gguf
from tests.engine.loading.test_gguf_spm import spm_vocab
from tests.ports import free_port
from tests.real_model import CHATS, RAW_PROMPTS, Reference

pytestmark = pytest.mark.slow
MAX_TOKENS = 24


def spm_llama_gguf(out):
    """A tiny llama GGUF (Q8_0) with the SentencePiece vocabulary; lm_head's rows of the byte tokens zeroed."""
    vocab = spm_vocab()
    hf_dir = make_tiny_model(out / "hf", "llama", vocab_size=len(vocab["tokens"]), num_layers=3)
    weights = load_file(str(hf_dir / "model.safetensors"))
    byte_ids = [i for i, t in enumerate(vocab["tokens"]) if t.startswith("<0x")]
    weights["lm_head.weight"][byte_ids] = 0.0
    save_file(weights, str(hf_dir / "model.safetensors"))
    return write_gguf(hf_dir, out / "tiny-spm.Q8_0.gguf", "Q8_0", spm=vocab)


def continuation(reference: Reference, prompt_ids: list[int], ids: list[int]) -> str:
    whole = reference.tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
    prompt = reference.tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert whole.startswith(prompt)
    return whole[len(prompt):]


def test_sentencepiece_llama_gguf_served_greedy_equals_transformers(ray_session, tmp_path):
    path = spm_llama_gguf(tmp_path)
    reference, name = Reference.load(path), "tiny-spm"
    port = free_port()
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(path), "--prefill", "1", "--decode", "1",
            "--local-prefill-max-tokens", "0", "--num-blocks", "160", "--max-model-len", "512", "--address",
            ray_session.get_runtime_context().gcs_address, "--port", str(port), "--grpc-port", str(free_port())]
    prompts = [*RAW_PROMPTS, "Ünïcode café 🙂 日本:"]  # the last one through byte fallback
    generated = []
    with serving(argv, tmp_path / "serve.log", port, signal.SIGINT):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=120)
        for prompt in prompts:
            ids = reference.prompt_ids(prompt)
            want = reference.greedy(ids, MAX_TOKENS)
            got = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert got.choices[0].text == continuation(reference, ids, want), prompt
            assert got.usage.prompt_tokens == len(ids) and ids[0] == reference.tokenizer.bos_token_id
            generated += want
        assert any(t.startswith("<0x") for t in reference.tokenizer.convert_ids_to_tokens(ids))  # byte fallback
        for label, messages in CHATS.items():
            ids = reference.chat_ids(messages)
            want = reference.greedy(ids, MAX_TOKENS)
            got = client.chat.completions.create(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
            assert got.choices[0].message.content == continuation(reference, ids, want), label
            assert got.usage.prompt_tokens == len(ids)
            generated += want
        stats = serve_worker_stats(ray_session)
    n_requests = len(prompts) + len(CHATS)
    assert stats["prefill-0"]["num_handoffs"] == n_requests
    assert stats["decode-0"]["num_remote_kv_received"] == n_requests
    assert sum(reference.tokenizer.convert_ids_to_tokens(i).startswith("\u2581") for i in generated) >= 10
