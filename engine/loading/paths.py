"""What a checkpoint path is, without opening it as a model: a GGUF file (by its magic) or a Hugging Face
directory, and the name it is served under (a Hub id's: its repository id, engine/hub/ref.py)."""
from __future__ import annotations

import re
from pathlib import Path

from engine.hub.ref import served_name

_GGUF_MAGIC = b"GGUF"
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|[Ff](?:16|32)|[Bb][Ff]16|TQ\d\w*|MXFP4)$")


def is_gguf(path: str | Path) -> bool:
    """A file (not a directory) that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == _GGUF_MAGIC


def checkpoint_name(path: str | Path) -> str:
    """The name a checkpoint is served under by default: a directory's name, or a GGUF file's stem without
    its quantization suffix (``SmolLM2-135M-Instruct.Q4_1.gguf`` → ``SmolLM2-135M-Instruct``); a Hub id's
    repository id (``org/name@v2:Q8_0`` → ``org/name``, as vLLM serves ``--model org/name``)."""
    hub = served_name(path)
    if hub is not None:
        return hub
    p = Path(path).resolve()
    return (_QUANT_SUFFIX.sub("", p.stem) or p.stem) if is_gguf(p) else p.name
