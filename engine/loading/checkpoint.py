"""The one place that knows the checkpoint formats: a Hugging Face directory or a GGUF file, whichever ``path``
is, gives its ``ModelConfig`` and its ``Tokenizer`` (vLLM's ``get_model_loader``). ``ModelConfig`` and ``Tokenizer``
themselves read only the Hugging Face files and know nothing of GGUF; engine/loading/gguf.py reads GGUF into them.
GGUF's reader loads on first use, so a caller of an HF directory never imports it."""
from __future__ import annotations

from pathlib import Path

from engine.errors import ModelLoadError
from engine.loading.paths import is_gguf
from engine.models.config import ModelConfig
from engine.text.tokenizer import Tokenizer


def load_model_config(path: str | Path) -> ModelConfig:
    """From a Hugging Face checkpoint directory or a GGUF file."""
    if is_gguf(path):
        from engine.loading.gguf import open_gguf

        return open_gguf(path).model_config()
    if not Path(path).exists():
        raise ModelLoadError(f"model {path}: no such file or directory")
    return ModelConfig.from_dir(path)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """From a Hugging Face checkpoint directory or a GGUF file (engine/loading/gguf_tokenizer.py)."""
    if is_gguf(path):
        from engine.loading.gguf import open_gguf

        return open_gguf(path).tokenizer()
    return Tokenizer.from_dir(path)
