"""The benchmark model as a Hugging Face directory that both duet and vLLM load.

``make bench-serve`` serves the same weights from every server: SmolLM2-135M-Instruct's Q4_1 GGUF (the
default model) dequantized by transformers to fp32 and saved with its tokenizer and chat template as
safetensors. Both servers then read the same ``config.json`` and ``tokenizer.json``.

    python -m bench.hf_model [OUT_DIR]      # prints the directory (built once, then reused)
"""
from __future__ import annotations

import fcntl
import json
import sys
from pathlib import Path

DEFAULT_DIR = Path(".cache/bench/SmolLM2-135M-Instruct")
COMPLETE = ".complete"  # written last: the directory is whole


def ensure_hf_model(out: Path = DEFAULT_DIR) -> Path:
    """The directory, written once: processes that ask at the same time (the suite's TEST_JOBS) wait on a lock
    for the one that writes it."""
    out = Path(out)
    stamp = out / COMPLETE
    if stamp.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            _write(out)
    return out


def _write(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loading.default_model import default_model_path

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    # The weights are already dequantized to fp32; what marks the model as "gguf-quantized" is bookkeeping
    # that save_pretrained refuses to serialize. Drop it so the directory is a plain fp32 checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "duet_source.json").write_text(json.dumps({"gguf": gguf.name, "dtype": "float32"}))
    (out / COMPLETE).touch()


if __name__ == "__main__":
    print(ensure_hf_model(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
