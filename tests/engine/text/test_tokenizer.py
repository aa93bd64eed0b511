"""engine.text.tokenizer against transformers' AutoTokenizer on the tiny checkpoints: encode, decode, chat
templates (text and ids), EOS sets, and a streaming detokenizer that never emits half a character."""

import json
import random
import shutil

import pytest
import transformers  # the reference (a test dependency: pip install .[test])

from engine.errors import InvalidRequestError, ModelLoadError
from engine.loading.tiny import ARCHITECTURES
from engine.text.tokenizer import IncrementalDetokenizer, Tokenizer

transformers.logging.set_verbosity_error()

ARCHS = sorted(ARCHITECTURES)
TEXTS = [
    "Hello world",
    "The model token cache, 2024! Isn't it great?",
    "héllo 世界 🙂",
    "🦀 ferris says ¿qué tal? 日本語のテキスト ßtraße",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "<s> literal specials </s> <|im_start|>user\nhi<|im_end|> <|eot_id|>",
    "def f(x):\n    return x ** 2  # 🚀",
    "cafe\u0301 vs café (NFC)",
    "",
    " ",
    "a" * 300,
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there 🙂"}],
    [
        {"role": "user", "content": "What is 世界?"},
        {"role": "assistant", "content": "The world. 🌍"},
        {"role": "user", "content": "  And now, <s> in text?  "},
    ],
]


@pytest.fixture(scope="module")
def tiny_dirs(tiny_model):
    """Default-argument checkpoint per arch (from the session cache in tests/conftest.py; never modified)."""
    return {arch: tiny_model(arch) for arch in ARCHS}


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tiny_dirs):
    """(ours, transformers') tokenizer for one arch."""
    model_dir = tiny_dirs[request.param]
    return Tokenizer.from_dir(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)


def hf_chat_ids(hf, messages, add_generation_prompt):
    return hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )


# ------------------------------------------------------------------------------------------ encode/decode


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, add_special_tokens):
    ours, hf = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pair, skip_special_tokens):
    ours, hf = pair
    rng = random.Random(0)
    streams = [hf.encode(text) for text in TEXTS]
    streams += [[rng.randrange(ours.vocab_size) for _ in range(40)] for _ in range(10)]  # invalid UTF-8 too
    streams.append([5, ours.vocab_size + 7, 6])  # past the vocabulary (padding rows of a bigger lm_head)
    for ids in streams:
        assert ours.decode(ids, skip_special_tokens) == hf.decode(ids, skip_special_tokens=skip_special_tokens)


def test_token_facts_match_transformers(pair):
    ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.eos_token == hf.eos_token and hf.eos_token_id in ours.eos_token_ids


def test_token_bytes_spell_the_text(pair):
    """token_bytes (grammar masks, engine/sampling/structured.py): a text's ids spell its (normalized) UTF-8 bytes."""
    ours, hf = pair
    token_bytes = ours.token_bytes()
    assert len(token_bytes) == ours.vocab_size
    assert {hf.bos_token_id, hf.eos_token_id} - {None} <= ours.special_token_ids
    for text in TEXTS:
        if "<" not in text:  # no special tokens (they are their text, matched whole)
            ids = ours.encode(text, add_special_tokens=False)
            assert b"".join(token_bytes[i] for i in ids) == ours.decode(ids).encode()


def test_token_bytes_of_sentencepiece_style_pieces(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    vocab = {"<unk>": 0, "\u2581world": 1, "<0x0A>": 2, "hé": 3}
    Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    assert Tokenizer.from_dir(tmp_path).token_bytes()[1:] == [b" world", b"\n", "hé".encode()]


def test_eos_ids_are_union_of_generation_config_and_tokenizer(tiny_dirs):
    expected = {
        "llama": {"</s>", "<|eot_id|>"},  # generation_config: <|eot_id|>, tokenizer: </s>
        "mistral": {"</s>"},
        "qwen2": {"<|im_end|>", "<|endoftext|>"},  # generation_config lists both
    }
    for arch, tokens in expected.items():
        tokenizer = Tokenizer.from_dir(tiny_dirs[arch])
        assert tokenizer.eos_token_ids == frozenset(tokenizer.token_to_id(t) for t in tokens), arch
        assert isinstance(tokenizer.eos_token_ids, frozenset)


# ------------------------------------------------------------------------------------------ chat template


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, add_generation_prompt):
    ours, hf = pair
    for messages in CONVERSATIONS:
        text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        ids = ours.encode_chat(messages, add_generation_prompt=add_generation_prompt)
        assert ids == hf_chat_ids(hf, messages, add_generation_prompt)
        if ours.bos_token_id is not None:
            assert ids[0] == ours.bos_token_id and ids[1] != ours.bos_token_id  # BOS once, from the template


def test_template_errors_are_invalid_requests(tiny_dirs):
    mistral = Tokenizer.from_dir(tiny_dirs["mistral"])
    with pytest.raises(InvalidRequestError, match="alternate"):
        mistral.apply_chat_template([{"role": "assistant", "content": "I speak first"}])
    with pytest.raises(InvalidRequestError, match="empty"):
        mistral.apply_chat_template([])


def test_template_features_match_transformers(tmp_path, tiny_dirs):
    """A chat_template.jinja (which wins over tokenizer_config) using HF's template helpers."""
    model_dir = tmp_path / "custom"
    shutil.copytree(tiny_dirs["qwen2"], model_dir)
    (model_dir / "chat_template.jinja").write_text(
        "{%- set ns = namespace(n=0) -%}\n"
        "{% for message in messages %}\n"
        "  {% if message['role'] == 'system' %}{% continue %}{% endif %}\n"
        "  {% set ns.n = ns.n + 1 %}\n"
        "<|im_start|>{{ message['role'] }}\n"
        "  {% generation %}{{ message['content'] }}{% endgeneration %}\n"
        "{{ message | tojson }}<|im_end|>\n"
        "{% endfor %}\n"
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}\n"
        "turns={{ ns.n }} year={{ strftime_now('%Y') }} eos={{ eos_token }} reasoning={{ messages[-1].thinking }}\n"
        "{% if messages | length > 3 %}{{ raise_exception('too many messages <&>') }}{% endif %}\n"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ours, hf = Tokenizer.from_dir(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "skipped"},
        {"role": "user", "content": "Quote \"<b>&</b>\" é 🙂", "name": None},
        {"role": "assistant", "content": "ok", "reasoning_content": "hmm"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = ours.apply_chat_template(messages, tools=tools)
    assert text == hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "null" not in text and "turns=2" in text and "reasoning=hmm" in text
    assert ours.encode_chat(messages) == hf_chat_ids(hf, messages, True)
    with pytest.raises(InvalidRequestError, match="too many messages <&>"):
        ours.apply_chat_template(messages + [{"role": "user", "content": "x"}])


def test_named_chat_templates_and_added_token_dicts(tmp_path, tiny_dirs):
    """tokenizer_config variants real checkpoints use: a template list, AddedToken dicts for specials."""
    model_dir = tmp_path / "variants"
    shutil.copytree(tiny_dirs["llama"], model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        {"name": "tool_use", "template": "{{ bos_token }}TOOLS{{ tools | length }}"},
    ]
    config["bos_token"] = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                           "rstrip": False, "single_word": False}
    config["eos_token"] = {"__type": "AddedToken", "content": "<|eot_id|>", "special": True}
    config_path.write_text(json.dumps(config))
    ours, hf = Tokenizer.from_dir(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = CONVERSATIONS[0]
    assert ours.bos_token == "<s>" and ours.eos_token == "<|eot_id|>"
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert ours.apply_chat_template(messages, tools=tools) == "<s>TOOLS1"
    assert hf.apply_chat_template(messages, tools=tools, tokenize=False) == "<s>TOOLS1"


def test_add_bos_token_when_post_processor_does_not(tmp_path, tiny_dirs):
    """Llama-2-style dirs: tokenizer.json adds no BOS but tokenizer_config says add_bos_token."""
    model_dir = tmp_path / "llama2_style"
    shutil.copytree(tiny_dirs["llama"], model_dir)
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = None
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    original, stripped = Tokenizer.from_dir(tiny_dirs["llama"]), Tokenizer.from_dir(model_dir)
    bos = stripped.bos_token_id
    for text in TEXTS:
        assert stripped.encode(text) == original.encode(text)
        assert stripped.encode(text).count(bos) == 1 + text.count("<s>")
        assert stripped.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    assert stripped.encode_chat(CONVERSATIONS[1]) == original.encode_chat(CONVERSATIONS[1])

    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["add_bos_token"] = False
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(model_dir).encode("hi") == original.encode("hi", add_special_tokens=False)


def test_missing_tokenizer_json_is_a_clear_load_error(tmp_path, tiny_dirs):
    model_dir = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_dirs["llama"], model_dir)
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json") as excinfo:
        Tokenizer.from_dir(model_dir)
    assert isinstance(excinfo.value, ValueError)
    (model_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(model_dir)


# ------------------------------------------------------------------------------------------ streaming


def stream(tokenizer, ids, prompt_ids=(), **kwargs):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = [detokenizer.add(token_id) for token_id in ids]
    return detokenizer, deltas


@pytest.mark.parametrize("arch", ARCHS)
def test_stream_never_emits_half_characters(tiny_dirs, arch):
    tokenizer = Tokenizer.from_dir(tiny_dirs[arch])
    prompt_ids = tokenizer.encode("Tell me: ")
    for text in TEXTS[2:4] + ["ßß 🦀🦀 日本 ✨ 🇯🇵"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        # The test is only meaningful if some token boundary falls inside a character.
        assert any(tokenizer.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids))), text
        detokenizer, deltas = stream(tokenizer, ids, prompt_ids)
        assert "".join(deltas) == detokenizer.text == tokenizer.decode(ids) == text
        assert not any("\ufffd" in delta for delta in deltas)
        assert detokenizer.flush() == ""


@pytest.mark.parametrize("arch", ARCHS)
def test_stream_of_random_ids_concatenates_to_full_decode(tiny_dirs, arch):
    """Random ids include lone continuation bytes and special tokens; after flush the text is exact."""
    tokenizer = Tokenizer.from_dir(tiny_dirs[arch])
    rng = random.Random(arch)
    for skip_special_tokens in (True, False):
        for _ in range(20):
            prompt_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(0, 8))]
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))]
            detokenizer, deltas = stream(tokenizer, ids, prompt_ids, skip_special_tokens=skip_special_tokens)
            assert not any(delta.endswith("\ufffd") for delta in deltas)
            deltas.append(detokenizer.flush())
            assert "".join(deltas) == detokenizer.text == tokenizer.decode(ids, skip_special_tokens)


def test_stream_skips_special_tokens_mid_stream(tiny_dirs):
    tokenizer = Tokenizer.from_dir(tiny_dirs["qwen2"])
    im_end = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("héllo 🦀", add_special_tokens=False) + [im_end] + tokenizer.encode(" 世界")
    detokenizer, deltas = stream(tokenizer, ids)
    assert deltas[len(ids) - len(tokenizer.encode(" 世界")) - 1] == ""  # the special token itself
    assert detokenizer.text == "héllo 🦀 世界" == tokenizer.decode(ids)
    _, deltas = stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(deltas) == "héllo 🦀<|im_end|> 世界"


def test_stream_keeps_leading_space_with_sentencepiece_style_decoder(tmp_path):
    """Metaspace decoders strip the first word's space in a plain decode; prompt context keeps it."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(
        ["hello world again and again", "the world says hello"] * 20,
        trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False),
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(tmp_path)
    prompt_ids, generated = tokenizer.encode("hello"), tokenizer.encode("world again")
    assert tokenizer.decode(generated) == "world again"
    detokenizer, deltas = stream(tokenizer, generated, prompt_ids)
    assert "".join(deltas) == detokenizer.text == " world again"
    assert stream(tokenizer, generated)[0].text == "world again"  # without context: as a plain decode
