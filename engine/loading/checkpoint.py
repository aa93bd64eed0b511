"""The one place that knows the checkpoint formats: a Hugging Face directory or a GGUF file, whichever ``model``
is, gives its ``ModelConfig`` and its ``Tokenizer`` (vLLM's ``get_model_loader``). ``ModelConfig`` and ``Tokenizer``
themselves read only the Hugging Face files and know nothing of GGUF; engine/loading/gguf.py reads GGUF into them.
GGUF's reader loads on first use, so a caller of an HF directory never imports it.

``model`` is a local path or a Hugging Face Hub id (engine/hub/ref.py): ``checkpoint_path`` turns an id into its
snapshot in the local cache (engine/hub/resolve.py; a pinned id whose files are cached costs no request), and a
Hub model's ``ModelConfig.model_id`` is its pinned id (``org/name@<commit>[:file.gguf]``): one value for every
worker that loads the same bytes."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.errors import ModelLoadError
from engine.hub.resolve import local_checkpoint, resolve_model
from engine.loading.paths import is_gguf
from engine.models.config import ModelConfig
from engine.text.tokenizer import Tokenizer


def checkpoint_path(model: str | Path) -> Path:
    """The local directory or GGUF file ``model`` names (a Hub id: fetched into the cache if it is not there)."""
    return local_checkpoint(model)


def load_model_config(model: str | Path) -> ModelConfig:
    """From a Hugging Face checkpoint directory or a GGUF file, local or on the Hub."""
    resolved = resolve_model(model)
    path = Path(model) if resolved is None else resolved.path
    if is_gguf(path):
        from engine.loading.gguf import open_gguf

        config = open_gguf(path).model_config()
    elif not path.exists():
        raise ModelLoadError(f"model {model}: no such file or directory")
    else:
        config = ModelConfig.from_dir(path)
    return config if resolved is None else dataclasses.replace(config, model_id=str(resolved.pinned))


def load_tokenizer(model: str | Path) -> Tokenizer:
    """From a Hugging Face checkpoint directory or a GGUF file (engine/loading/gguf_tokenizer.py), local or on the Hub."""
    path = checkpoint_path(model)
    if is_gguf(path):
        from engine.loading.gguf import open_gguf

        return open_gguf(path).tokenizer()
    return Tokenizer.from_dir(path)
