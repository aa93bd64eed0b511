"""A ``Tokenizer`` from a GGUF file's metadata (a GGUF has no tokenizer.json: vocabulary, merges, token types
and special-token ids are metadata under llama.cpp's key names).

Supported:
- ``tokenizer.ggml.model == "gpt2"`` — byte-level BPE, what Llama 3, Qwen2 and SmolLM use. The text is split
  before BPE the way llama.cpp splits it for the file's ``tokenizer.ggml.pre`` (the regex the vocabulary's
  merges were learned with; :data:`_PRE_TOKENIZERS`). A pre-tokenizer we do not know or a missing one is a
  ``ModelLoadError``: guessing the split gives other token ids than the model was trained on, without an error.
- ``tokenizer.ggml.model == "llama"`` — SentencePiece BPE, byte fallback to the ``<0xNN>`` tokens, unknown pieces
  fused; the merges the file lists, or — llama.cpp's converter writes none — the ones its vocabulary implies,
  best merged piece first (:func:`spm_merges`). BOS is added unless the file says ``add_bos_token = false``.
  How spaces are spelled depends on the family and a file does not say it, so it goes by architecture, as
  transformers' GGUF tokenizers do: ``llama`` (Llama 2, Mistral, TinyLlama) as its ``LlamaTokenizer`` — "▁" for
  spaces, one prepended to the text (Metaspace); ``phi3`` the same but prepended by a normalizer ("  hi" →
  "▁▁▁hi", where Metaspace gives "▁▁hi"); ``gemma2`` / ``gemma3`` as its ``GemmaTokenizer`` — no prefix,
  tokens that are runs of spaces looked up as runs of "▁", the merges ranked by the pieces' order in the file
  (Gemma's scores do not follow its merge order). Other architectures' SentencePiece files and other models ("t5",
  "bert", ...) are refused.

Token types follow llama.cpp: CONTROL tokens (``<|im_start|>``, ...) are special added tokens (matched whole,
dropped by ``skip_special_tokens``), USER_DEFINED ones are plain added tokens (matched whole, kept). EOS for
generation is the EOS id plus the end-of-turn / end-of-message ids when the file names them (Phi-3 and Gemma
files do not: their turn's end, ``<|end|>`` / ``<end_of_turn>``, is found by its text, as llama.cpp finds it —
:data:`_END_OF_TURN`). BOS/EOS are added to encoded text only when ``add_bos_token`` / ``add_eos_token`` say
so. Chat templates: ``tokenizer.chat_template`` (default) and ``tokenizer.chat_template.<name>`` (e.g. tool_use).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from engine.errors import ModelLoadError
from engine.text.tokenizer import Tokenizer, byte_alphabet

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_SPM_ARCHITECTURES = ("llama", "phi3", "gemma2", "gemma3")
# The chat turn's end in families whose converted files carry no eot_token_id (llama.cpp's converter writes only
# the EOS): llama.cpp ends generation on these tokens, found by their text, as the checkpoints' own
# generation_config.json does (Phi-3: <|end|>, Gemma: <end_of_turn>).
_END_OF_TURN = {"phi3": "<|end|>", "gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>"}

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's pre-tokenizer types (src/llama-vocab.cpp) -> the regexes applied in order, and whether BPE
# looks a whole pre-token up in the vocabulary before merging (llama.cpp's ignore_merges, Llama 3's tokenizer.json).
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gpt-2": ((_GPT2_SPLIT,), False),
    "smollm": ((r"\p{N}", _GPT2_SPLIT), False),
    "starcoder": ((r"\p{N}", _GPT2_SPLIT), False),
    "refact": ((r"\p{N}", _GPT2_SPLIT), False),
    "llama3": ((_LLAMA3_SPLIT,), True),
    "llama-v3": ((_LLAMA3_SPLIT,), True),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "qwen2": ((_QWEN2_SPLIT,), False),
    "deepseek-r1-qwen": ((_QWEN2_SPLIT,), False),
}


def spm_merges(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a piece into two pieces of the
    vocabulary, best merged piece first (score descending; ties: longer left, then longer right piece, then
    the pieces' order in the vocabulary) — the order transformers recovers them in."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _spm_backend(meta: Mapping[str, Any], tokens: list[str], source: str) -> _Backend:
    arch = meta.get("general.architecture")
    if arch not in _SPM_ARCHITECTURES:
        raise ModelLoadError(f"{source}: a SentencePiece tokenizer in a {arch!r} file is not supported (only in "
                             f"{', '.join(repr(a) for a in _SPM_ARCHITECTURES)} files: families spell their spaces "
                             "differently, and a file does not say how)")
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError(f"{source}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
    gemma = arch in ("gemma2", "gemma3")
    if gemma:  # runs of spaces stored as spaces, looked up as "▁"s; merges ranked by position, not score
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {t: -float(i) for i, t in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, scores))
    vocab = {t: i for i, t in enumerate(tokens)}
    listed = meta.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in listed] if listed else spm_merges(vocab, ranks)
    backend = _Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                           **({"unk_token": "<unk>"} if gemma else {})))
    pieces = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:  # no prefix space
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(pieces)
        return backend
    if arch == "phi3":  # the prefix space from a normalizer: "  hi" -> "▁▁▁hi" (Metaspace: "▁▁hi")
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([*pieces, decoders.Strip(content=" ", left=1)])
    return backend


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any], source: str = "GGUF file") -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ModelLoadError(f"{source}: tokenizer.ggml.model={model!r} is not supported (supported: 'gpt2', "
                             "byte-level BPE; 'llama', SentencePiece BPE); serve the model's Hugging Face "
                             "directory instead")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if model == "llama":
        backend = _spm_backend(meta, tokens, source)
        return _finish(backend, meta, tokens, token_types, source, add_bos_default=True, byte_level=False)
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(f"{source}: tokenizer.ggml.pre={pre!r} is not a pre-tokenizer duet knows "
                             f"({', '.join(sorted(_PRE_TOKENIZERS))}); splitting text another way would change "
                             "the token ids")
    splits, ignore_merges = _PRE_TOKENIZERS[pre]
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = []
    for m in meta.get("tokenizer.ggml.merges") or []:
        pair = m.split(" ")
        if len(pair) != 2:
            raise ModelLoadError(f"{source}: malformed merge {m!r}")
        merges.append((pair[0], pair[1]))
    backend = _Backend(BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return _finish(backend, meta, tokens, token_types, source, add_bos_default=False, byte_level=True)


def _finish(backend: _Backend, meta: Mapping[str, Any], tokens: list[str], token_types: list[int], source: str, *,
            add_bos_default: bool, byte_level: bool) -> Tokenizer:
    """Added tokens, BOS/EOS, chat templates: the same for every tokenizer model."""
    alphabet = set(byte_alphabet().values())
    vocab = backend.get_vocab()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, token_types)
                                if kind == _CONTROL and (not byte_level or set(t) <= alphabet)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise ModelLoadError(f"{source}: tokenizer.ggml.{key}={i} is outside the vocabulary")
        return tokens[int(i)]

    special = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
               "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    # the named ones are special whatever their type (an UNKNOWN-typed <unk>: matched whole, skipped in decode)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()
                                if t is not None and t in vocab])
    template = [special["bos_token"]] * bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) + ["$A"]
    template += [special["eos_token"]] * bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if None in template:
        raise ModelLoadError(f"{source}: add_bos_token/add_eos_token set but the token id is missing")
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(template), special_tokens=[(t, backend.token_to_id(t)) for t in template if t != "$A"])
    eos_ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                      "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    if meta.get("general.architecture") in _END_OF_TURN:  # its files name no end-of-turn id: llama.cpp's rule
        eos_ids += [i for i, t in enumerate(tokens) if t == _END_OF_TURN[meta["general.architecture"]]]
    templates = {"default": meta["tokenizer.chat_template"]} if "tokenizer.chat_template" in meta else {}
    for key, value in meta.items():
        if key.startswith("tokenizer.chat_template."):
            templates[key.removeprefix("tokenizer.chat_template.")] = value
    return Tokenizer(backend, special, generation_eos_token_ids=eos_ids, chat_templates=templates)
