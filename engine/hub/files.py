"""Which of a Hub repository's files duet fetches: those the engine reads, never more.

A safetensors repository gives ``config.json``, ``generation_config.json``, the tokenizer's files
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja`` /
``chat_template.json``: what engine/text/tokenizer.py and engine/models/config.py open) and the weights:
``model.safetensors.index.json`` and the shards it names (the caller reads the index once fetched:
``index_shards``), else every ``*.safetensors`` at the top level. Nothing in a subfolder (``original/``,
``onnx/``), and never a pickle (``*.bin``, ``*.pt``, ``*.pth``: loading one runs code). ``config.json`` and
``tokenizer.json`` are required (the engine reads only "fast" tokenizers).

A GGUF repository gives one ``.gguf`` file (config, tokenizer and weights in one): the one named, or the one
whose name carries the quantization tag asked for. The tag matches as llama.cpp's ``-hf org/name:TAG`` matches
it (``TAG`` followed by ``.`` or ``-``, any case, projector / imatrix files left out), stricter in two ways:
the tag must start at a word boundary (``F16`` does not match ``BF16``) and more than one match is an error
listing them, where llama.cpp takes the first. With no tag, a repository with safetensors weights serves those;
a GGUF-only one serves its only model file, or else llama.cpp's default tags in order (``Q4_K_M``, ``Q8_0``),
logged; otherwise the error lists the files. A split GGUF (``-00001-of-00003.gguf``) is refused: duet reads one
file. Every refusal names the repository, the revision and the files it has. Pure: a listing in, names out.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
REQUIRED = ("config.json", "tokenizer.json")
OPTIONAL = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
            "chat_template.json")
PICKLES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
DEFAULT_GGUF_TAGS = ("Q4_K_M", "Q8_0")  # llama.cpp's, in its order (common/download.cpp find_best_model)
_NOT_MODEL_GGUF = ("mmproj", "imatrix")  # a vision projector or an importance matrix: never the model
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_LISTED = 30  # files named in an error, at most


@dataclass(frozen=True)
class Selection:
    """``kind`` "safetensors": ``files`` (the index, if any, among them: its shards come once it is read);
    "gguf": ``files`` is the one file, also ``gguf_file``."""

    kind: str
    files: tuple[str, ...]
    gguf_file: str | None = None


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # a PEFT LoRA adapter (engine/lora/adapter.py)


def select_adapter_files(files: list[str], selector: str | None, where: str) -> Selection:
    """A PEFT adapter repository's files duet reads: ``adapter_config.json`` and ``adapter_model.safetensors`` at its
    top (kind "lora"); a missing one, a ``:`` selector (adapters have no quantizations) or pickled weights only are
    errors naming the files."""
    if selector is not None:
        raise ModelLoadError(f"{where}: {selector!r}: a LoRA adapter is named org/name[@revision], without a "
                             "quantization or file")
    top = set(f for f in files if "/" not in f)
    missing = [f for f in ADAPTER_FILES if f not in top]
    if missing:
        pickles = [f for f in files if f.endswith(PICKLES)]
        hint = f"; its pickled weights ({_names(pickles)}) are never loaded" if pickles else ""
        raise ModelLoadError(f"{where}: no {' or '.join(missing)} at the top of the repository: not a PEFT LoRA "
                             f"adapter duet reads{hint} (its files: {_names(files)})")
    return Selection("lora", ADAPTER_FILES)


def select_files(files: list[str], selector: str | None, where: str) -> Selection:
    """The files of a repository listing (``files``, paths relative to its root) that duet fetches; ``where``
    names the repository and revision in errors (``org/name@main``)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if selector is not None:
        if not ggufs:
            raise ModelLoadError(f"{where}: {selector!r} names a GGUF file or quantization, but the repository has "
                                 f"no .gguf file (its files: {_names(files)})")
        return _gguf(_named(ggufs, selector, where) if selector.lower().endswith(".gguf")
                     else _tagged(ggufs, selector, where), where)
    top = set(f for f in files if "/" not in f)
    weights = [INDEX] if INDEX in top else sorted(f for f in top if f.endswith(".safetensors"))
    if weights:
        missing = [f for f in REQUIRED if f not in top]
        if missing:
            raise ModelLoadError(f"{where}: no {' or '.join(missing)} at the top of the repository, which duet reads "
                                 f"with the weights (its files: {_names(files)})")
        if ggufs:
            log.info("%s has safetensors weights and GGUF files: serving the safetensors (name a quantization, "
                     "%s:QUANT, for a GGUF file)", where, where.split("@")[0])
        return Selection("safetensors", tuple(f for f in (*REQUIRED, *OPTIONAL) if f in top) + tuple(weights))
    models = [f for f in ggufs if _is_model_gguf(f)]
    if len(models) == 1:
        return _gguf(models[0], where)
    if models:
        for tag in DEFAULT_GGUF_TAGS:
            found = _matches(models, tag)
            if len(found) == 1:
                log.warning("%s: no quantization named; taking %s, llama.cpp's default (its GGUF files: %s)",
                            where, found[0], _names(models))
                return _gguf(found[0], where)
        raise ModelLoadError(f"{where}: several GGUF files and no quantization named: add one, e.g. "
                             f"{where.split('@')[0]}:Q8_0, or a file name (its GGUF files: {_names(models)})")
    pickles = [f for f in files if f.endswith(PICKLES)]
    hint = f"; its pickled weights ({_names(pickles)}) are never loaded" if pickles else ""
    raise ModelLoadError(f"{where}: no weights in a format duet reads (model.safetensors [+ {INDEX}] at the top "
                         f"of the repository, or a .gguf file){hint} (its files: {_names(files)})")


def index_shards(index: Path, listed: list[str], where: str) -> list[str]:
    """The shards a fetched ``model.safetensors.index.json`` names; each must be in the repository listing."""
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise ModelLoadError(f"{where}: {INDEX} is not a safetensors index ({e!r})") from None
    missing = [s for s in shards if s not in listed]
    if missing:
        raise ModelLoadError(f"{where}: {INDEX} names shards the repository lacks: {_names(missing)}")
    return shards


def _named(ggufs: list[str], name: str, where: str) -> str:
    exact = [f for f in ggufs if f == name] or [f for f in ggufs if f.lower() == name.lower()]
    if not exact:
        raise ModelLoadError(f"{where}: no file {name!r} (its GGUF files: {_names(ggufs)})")
    return exact[0]


def _tagged(ggufs: list[str], tag: str, where: str) -> str:
    models = [f for f in ggufs if _is_model_gguf(f)]
    found = _matches(models, tag)
    if not found:
        raise ModelLoadError(f"{where}: no GGUF file matches quantization {tag!r} (its GGUF files: {_names(models)})")
    if len(found) > 1:
        raise ModelLoadError(f"{where}: quantization {tag!r} matches several GGUF files: {_names(found)}; name "
                             f"one: {where.split('@')[0]}:<file>.gguf")
    return found[0]


def _matches(models: list[str], tag: str) -> list[str]:
    """Model files whose name carries ``tag``; a split model counts once (its first part)."""
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}[.-]", re.IGNORECASE)
    hits = [f for f in models if pattern.search(f.rsplit("/", 1)[-1])]
    return [f for f in hits if not (m := _SPLIT.search(f)) or int(m.group(1)) == 1]


def _gguf(name: str, where: str) -> Selection:
    split = _SPLIT.search(name)
    if split and int(split.group(2)) > 1:
        raise ModelLoadError(f"{where}: {name} is part 1 of a GGUF split in {int(split.group(2))} files; duet reads "
                             "one file (merge the parts with llama.cpp's `llama-gguf-split --merge`)")
    return Selection("gguf", (name,), name)


def _is_model_gguf(path: str) -> bool:
    base = path.rsplit("/", 1)[-1].lower()
    return not any(k in base for k in _NOT_MODEL_GGUF)


def _names(files: list[str]) -> str:
    shown = ", ".join(sorted(files)[:_LISTED])
    return (shown + f", ... ({len(files)} files)") if len(files) > _LISTED else (shown or "none")
