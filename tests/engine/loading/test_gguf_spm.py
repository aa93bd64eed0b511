"""SentencePiece GGUF files (tokenizer.ggml.model = "llama", as llama.cpp writes Llama 2 / Mistral / TinyLlama:
pieces with scores, <0xNN> byte tokens, no merges) against transformers' own GGUF tokenizer for the same file:
encode and decode, specials and byte fallback included — in llama files and in phi3 / gemma2 / gemma3 files,
which spell their spaces otherwise; then a tiny llama GGUF with that vocabulary generates what transformers
generates from the same file and text (issue 26, must-show 2; served: tests/cluster/test_gguf_spm_serve.py)."""
from __future__ import annotations

import pytest
import torch
import transformers
from tokenizers import SentencePieceBPETokenizer

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.loading.gguf import GGUFCheckpoint
from engine.loading.tiny import make_tiny_model, tiny_corpus
from engine.request import SamplingParams
from tests.engine.loading.gguf_files import write_gguf
from tests.engine.loading.hf_saved import hf_reference, save_with_transformers

CONTROL, USER = ["<|user|>", "<|assistant|>"], ["<tool>"]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TEXTS = ["Hello world", " leading space", "two  spaces and   three", "new\nline\n\n", "café ünïcode 日本語 🙂 ñ",
         "<|user|>\nhi</s>", "a <tool> b<tool>", "", "   ", "The river and the mountain garden.", "x" * 40,
         "<s>not special in text?</s>", "an <unk> named special", "def f_3(x): return x * 7  # ok"]


def spm_vocab() -> dict:
    """A SentencePiece-style vocabulary trained here (the tokenizers library's SentencePiece BPE), laid out as
    llama.cpp writes one: unk, BOS, EOS, the 256 byte tokens, control and user-defined tokens, then the pieces
    with descending scores. A small alphabet leaves accented, CJK and emoji characters to byte fallback."""
    spm = SentencePieceBPETokenizer()
    spm.train_from_iterator(tiny_corpus(), vocab_size=320, min_frequency=2, special_tokens=["<unk>"],
                            limit_alphabet=50, show_progress=False)
    pieces = [p for p, _ in sorted(spm.get_vocab().items(), key=lambda kv: kv[1]) if p != "<unk>"]
    head = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *CONTROL, *USER]
    types = [2, 3, 3, *[6] * 256, *[3] * len(CONTROL), *[4] * len(USER)]
    tokens = head + pieces
    return {"tokens": tokens, "scores": [0.0] * len(head) + [-float(i) for i in range(len(pieces))],
            "token_type": types + [1] * len(pieces), "bos": 1, "eos": 2, "unk": 0, "chat_template": TEMPLATE}


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    vocab = spm_vocab()
    out = tmp_path_factory.mktemp("spm")
    hf_dir = make_tiny_model(out / "hf", "llama", vocab_size=len(vocab["tokens"]))
    return write_gguf(hf_dir, out / "tiny-spm.gguf", "Q8_0", spm=vocab)


def assert_same_tokenizer(path, texts=TEXTS) -> None:
    """Our tokenizer of a GGUF file against transformers' for it: encode (with and without specials), decode
    (with and without skipping them), the chat template; byte fallback must really have run."""
    ours = GGUFCheckpoint(path).tokenizer()
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    fallback = 0
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref(text, add_special_tokens=special)["input_ids"], (text, special)
        fallback += sum(t.startswith("<0x") for t in ref.convert_ids_to_tokens(ids))
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)
    assert fallback >= 10  # byte fallback really ran (é, ü, 日本語, 🙂 are not pieces)
    assert ours.encode("x")[0] == 1  # BOS added: the file does not say otherwise
    messages = [{"role": "user", "content": "Tell me about the river."}]
    text = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_sentencepiece_gguf_tokenizer_equals_transformers(spm_gguf):
    assert_same_tokenizer(spm_gguf)


TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
FAMILY = {  # tiny configs of the families whose SentencePiece files spell spaces their own way
    "phi3": lambda n: transformers.Phi3Config(vocab_size=n, **TINY, pad_token_id=0),
    "gemma2": lambda n: transformers.Gemma2Config(vocab_size=n, **TINY, head_dim=16),
    "gemma3": lambda n: transformers.Gemma3TextConfig(vocab_size=n, **TINY, head_dim=16),
}


@pytest.mark.parametrize("family", list(FAMILY))
def test_phi3_and_gemma_sentencepiece_gguf_tokenizers_equal_transformers(tmp_path, tiny_model, family):
    """Phi-3 prepends its "▁" with a normalizer (it shows on text that starts with spaces); Gemma prepends none, and
    its files store the tokens that are runs of spaces as spaces (llama.cpp's converter sets add_space_prefix
    false for it). Neither family's files name their end-of-turn token."""
    vocab = spm_vocab()
    gemma = family.startswith("gemma")
    end_of_turn = "<end_of_turn>" if gemma else "<|end|>"  # a control token; the file names no eot id
    extra = {end_of_turn: 3} | ({"  ": 4, "   ": 4} if gemma else {})  # Gemma's runs of spaces: user-defined
    vocab = {**vocab, "tokens": vocab["tokens"] + list(extra), "scores": vocab["scores"] + [0.0] * len(extra),
             "token_type": vocab["token_type"] + list(extra.values())}
    hf_dir = save_with_transformers(tmp_path / "hf", FAMILY[family](len(vocab["tokens"])), tiny_model("llama"))
    path = write_gguf(hf_dir, tmp_path / f"{family}-spm.gguf", spm=vocab,
                      metadata={"tokenizer.ggml.add_space_prefix": False} if gemma else {})
    assert_same_tokenizer(path, TEXTS + ["  hi", "a  b   c", "\n\nx  ", f"ok{end_of_turn}\n"])
    # generation ends on the turn's end too (llama.cpp's rule; the checkpoints' generation_config.json says so)
    assert GGUFCheckpoint(path).tokenizer().eos_token_ids == {2, vocab["tokens"].index(end_of_turn)}


@pytest.mark.slow
def test_llama_gguf_with_a_sentencepiece_vocabulary_generates_like_transformers(spm_gguf):
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(spm_gguf.parent), gguf_file=spm_gguf.name)
    ref = hf_reference(spm_gguf.parent, gguf_file=spm_gguf.name)
    engine = Engine(EngineConfig(model=str(spm_gguf), num_blocks=64, dtype="float32"))
    prompts = ["The river and the mountain garden", "café 🙂 def f(x):"]
    res = engine.generate([engine.tokenizer.encode(p) for p in prompts],
                          SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for p, r in zip(prompts, res):
        ids = ref_tok(p)["input_ids"]
        assert engine.tokenizer.encode(p) == ids
        want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
        assert r["token_ids"] == want
        # as text: random weights emit byte tokens that are not UTF-8, where a streamed text has no one right
        # spelling (tokenizers turns a whole invalid run into U+FFFD, a streaming window cuts it elsewhere), so
        # the whole decode is compared, both ways of treating specials
        for skip in (True, False):
            assert engine.tokenizer.decode(ids + want, skip) == ref_tok.decode(ids + want, skip_special_tokens=skip)


def test_sentencepiece_in_another_architecture_or_without_scores_is_refused(spm_gguf, tmp_path):
    from engine.loading.gguf_tokenizer import tokenizer_from_gguf_metadata

    meta = dict(GGUFCheckpoint(spm_gguf).metadata)
    with pytest.raises(ModelLoadError, match="SentencePiece tokenizer in a 'qwen2' file"):
        tokenizer_from_gguf_metadata({**meta, "general.architecture": "qwen2"})
    with pytest.raises(ModelLoadError, match="needs tokenizer.ggml.scores"):
        tokenizer_from_gguf_metadata({k: v for k, v in meta.items() if k != "tokenizer.ggml.scores"})
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.model='t5'"):
        tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.model": "t5"})
