"""Tokenizer, chat template and streaming detokenizer for HF checkpoint directories, without transformers.

The router tokenizes prompts and the workers detokenize what they generate, so both must agree with what
``transformers.AutoTokenizer`` would do for the same directory — the parity tests compare against it.

- Only "fast" tokenizers are supported: ``tokenizer.json`` is loaded with the ``tokenizers`` library and
  used as is (normalizer, pre-tokenizer, post-processor). Truncation/padding saved in the file are
  switched off, as transformers does for a plain ``encode``.
- ``tokenizer_config.json`` supplies the named special tokens (a string or an AddedToken dict), added tokens
  missing from tokenizer.json, and ``add_bos_token``. That flag is honoured only where tokenizer.json's
  post-processor does not add BOS itself (Llama-2 style dirs whose tokenizer.json lacks the template): the
  model needs its BOS either way. transformers 5 ignores the flag for tokenizer.json-backed tokenizers.
- The chat template comes from ``chat_template.jinja``, else ``chat_template.json``, else the config's
  ``chat_template`` (a string, or a list of ``{name, template}``: "tool_use" when tools are given, else
  "default"). It is rendered the way transformers renders it (engine/text/chat_template.py), every named special
  token passed as a variable.
  The rendered text already holds the template's BOS, so :meth:`Tokenizer.encode_chat` encodes it with
  ``add_special_tokens=False``, exactly like ``apply_chat_template(tokenize=True)``.
- EOS is a set: generation_config.json's ``eos_token_id`` (int or list; config.json's if there is no
  generation config) plus the tokenizer's own EOS. Instruct models stop on several tokens.
- :class:`IncrementalDetokenizer` streams text with the prefix-offset / read-offset technique of vLLM and
  TGI: decode a small window of ids twice (without and with the new ids) and emit the difference only when
  the window's text does not end in U+FFFD, i.e. when no byte-level token has left a UTF-8 character
  half-finished. Up to 5 prompt ids serve as left context (unless the prompt ends inside a character).
  For byte-level BPE (Llama 3, Qwen2, the tiny models) everything it emits, after ``flush()``, is exactly
  ``decode(generated_ids)``; for SentencePiece-style decoders it keeps the leading space of the first
  generated word, which a decode of the generated ids alone would strip.
- Ids past the tokenizer's vocabulary (padding rows of a larger lm_head) decode to nothing, as in HF.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tokenizers import AddedToken, decoders
from tokenizers import Tokenizer as _Backend

from engine.errors import InvalidRequestError, ModelLoadError
from engine.text import chat_template

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a chat template may read (bos_token, eos_token, ...).
SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """One checkpoint's tokenizer. Build with :meth:`from_dir`; immutable afterwards."""

    def __init__(
        self,
        backend: _Backend,
        special_tokens: Mapping[str, str],
        *,
        add_bos_token: bool = False,
        generation_eos_token_ids: Iterable[int] = (),
        chat_templates: Mapping[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
    ):
        self._backend = backend
        self.special_tokens = MappingProxyType({r: t for r, t in special_tokens.items() if t is not None})
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.pad_token_id = self._id_of(self.special_tokens.get("pad_token"))
        eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        self.eos_token_ids: frozenset[int] = frozenset(
            [*generation_eos_token_ids, *([] if eos_token_id is None else [eos_token_id])]
        )
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # Prepend BOS ourselves only when asked to and the post-processor does not already do it.
        self._prepend_bos = (
            add_bos_token and self.bos_token_id is not None and not self._post_processor_adds(self.bos_token_id)
        )
        self._chat_templates = dict(chat_templates or {})
        for template in self._chat_templates.values():
            chat_template.check(template)
        # transformers 5 skips this clean-up for BPE models (it would eat real spaces before punctuation).
        self._clean_up_spaces = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ generation_config, chat template files)."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{model_dir}: no tokenizer.json (only 'fast' tokenizers are supported; convert a "
                "sentencepiece/vocab-only tokenizer with transformers' save_pretrained first)"
            )
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust library raises plain Exception on a malformed file
            raise ModelLoadError(f"{tokenizer_file}: cannot be loaded: {e}") from e
        backend.no_truncation()
        backend.no_padding()

        config = _read_json(model_dir / "tokenizer_config.json")
        special_tokens_map = _read_json(model_dir / "special_tokens_map.json")
        special_tokens = {
            role: _token_content(config[role] if role in config else special_tokens_map.get(role))
            for role in SPECIAL_TOKEN_ROLES
        }
        _add_missing_tokens(backend, config.get("added_tokens_decoder", {}), special_tokens.values())
        return cls(
            backend,
            special_tokens,
            add_bos_token=bool(config.get("add_bos_token", False)),
            generation_eos_token_ids=_generation_eos_ids(model_dir),
            chat_templates=_read_chat_templates(model_dir, config),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    # ------------------------------------------------------------------------------------------ tokens

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special added tokens (``<|im_end|>``, ...): matched whole, dropped by skip_special_tokens."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def token_bytes(self) -> list[bytes]:
        """Every id's raw bytes (index = id), for grammar masks (engine/sampling/structured.py). Byte-level BPE
        spellings are mapped back through GPT-2's byte alphabet; SentencePiece pieces get ``▁`` as a space and
        ``<0xNN>`` as that byte; added tokens are their text. Ids the vocabulary skips are ``b""``."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        added_ids = set(self._backend.get_added_tokens_decoder())
        byte_of = {c: b for b, c in byte_alphabet().items()}
        byte_level = isinstance(self._backend.decoder, decoders.ByteLevel)
        out = [b""] * (max(vocab.values()) + 1)
        for text, i in vocab.items():
            if i in added_ids:
                out[i] = text.encode("utf-8")
            elif byte_level and all(c in byte_of for c in text):
                out[i] = bytes(byte_of[c] for c in text)
            elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                out[i] = bytes([int(text[3:5], 16)])
            else:
                out[i] = text.replace("\u2581", " ").encode("utf-8")
        return out

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor's BOS/EOS (and ours)."""
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    # ------------------------------------------------------------------------------------------ chat

    @property
    def chat_template(self) -> str | None:
        """The template used without tools (``default``), or None if the checkpoint has none."""
        return self._chat_templates.get("default")

    @property
    def tool_chat_template(self) -> str | None:
        """The template used with tools (``tool_use`` when the checkpoint has one, else the default)."""
        return self._chat_templates.get("tool_use", self._chat_templates.get("default"))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` as transformers' ``apply_chat_template(..., tokenize=False)`` does."""
        name = "tool_use" if tools is not None and "tool_use" in self._chat_templates else "default"
        template = self._chat_templates.get(name)
        if template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        if not messages:
            raise InvalidRequestError("cannot apply the chat template to an empty list of messages")
        variables = {**self.special_tokens, **template_kwargs}  # kwargs win, as in transformers
        return chat_template.render(template, messages, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt, variables=variables)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Ids of the rendered chat; its BOS comes from the template, so none is added on top."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------------------------------ helpers

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _post_processor_adds(self, token_id: int) -> bool:
        with_specials = self._backend.encode("a", add_special_tokens=True).ids
        return token_id in with_specials and token_id not in self._backend.encode("a", add_special_tokens=False).ids


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas that never end inside a UTF-8 character.

    The window holds ids whose text was already emitted (``[:read_offset]``, at most a few) followed by ids
    not yet emitted. Both parts are decoded together so that decoders that depend on context
    (leading-space stripping, byte-level merges) see the same neighbourhood as a full decode; the emitted
    part is dropped from the window as soon as newer text is emitted, so memory stays O(window).
    """

    _PROMPT_CONTEXT_TOKENS = 5  # as vLLM: enough left context for any decoder's rules

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context_ids = list(prompt_ids)[-self._PROMPT_CONTEXT_TOKENS :]
        if tokenizer.decode(context_ids, skip_special_tokens).endswith("\ufffd"):
            # The prompt ends inside a character: generated bytes would complete it and the emitted text
            # would no longer be decode(generated ids). Start without context instead.
            context_ids = []
        self._window_ids = context_ids
        self._read_offset = len(context_ids)
        self._chunks: list[str] = []
        self.num_tokens = 0

    @property
    def text(self) -> str:
        """All text emitted so far (the generated part only, never the prompt)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        """Append one generated id; return the newly completed text ("" while a character is unfinished)."""
        self._window_ids.append(token_id)
        self.num_tokens += 1
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of a stream: emit whatever is pending, even an unfinished character (as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        emitted_text = self._tokenizer.decode(self._window_ids[: self._read_offset], self._skip_special_tokens)
        window_text = self._tokenizer.decode(self._window_ids, self._skip_special_tokens)
        if len(window_text) <= len(emitted_text) or (window_text.endswith("\ufffd") and not final):
            return ""
        delta = window_text[len(emitted_text) :]
        self._window_ids = self._window_ids[self._read_offset :]
        self._read_offset = len(self._window_ids)
        self._chunks.append(delta)
        return delta


# ---------------------------------------------------------------------------------------------- loading


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map (the spelling of every byte-level BPE vocabulary)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    others = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from e


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    """A special token from tokenizer_config: a plain string or an AddedToken dict ``{"content": ...}``."""
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, Mapping) and isinstance(token.get("content"), str):
        return token["content"]
    raise ModelLoadError(f"tokenizer_config.json: cannot read special token {token!r}")


def _add_missing_tokens(backend: _Backend, added_tokens_decoder: Mapping, special_tokens: Iterable) -> None:
    """Register tokens the config declares but tokenizer.json lacks, as transformers does on load."""
    for entry in added_tokens_decoder.values():
        if backend.token_to_id(entry["content"]) is None:
            token = AddedToken(
                entry["content"],
                single_word=entry.get("single_word", False),
                lstrip=entry.get("lstrip", False),
                rstrip=entry.get("rstrip", False),
                normalized=entry.get("normalized", not entry.get("special", False)),
                special=entry.get("special", False),
            )
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    missing = [t for t in special_tokens if t is not None and backend.token_to_id(t) is None]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def _generation_eos_ids(model_dir: Path) -> list[int]:
    generation_config = _read_json(model_dir / "generation_config.json")
    source = generation_config if generation_config else _read_json(model_dir / "config.json")
    eos = source.get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def _read_chat_templates(model_dir: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates; the separate files take priority over tokenizer_config, as in transformers."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    template = _read_json(model_dir / "chat_template.json").get("chat_template", config.get("chat_template"))
    if template is None:
        return {}
    if isinstance(template, str):
        return {"default": template}
    return {entry["name"]: entry["template"] for entry in template}


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (WordPiece-era space removal before punctuation)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
