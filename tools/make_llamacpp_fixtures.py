"""Writes tests/engine/loading/llamacpp_files/: a tiny random Llama quantized by llama.cpp's own llama-quantize.

    python -m tools.make_llamacpp_fixtures [--quantize .cache/llama.cpp/build/bin/llama-quantize]

The gguf package quantizes the 32-blocks but not the k-quants (tests/engine/loading/gguf_files.py writes random
k-quant blocks instead), so these files are the k-quants as llama.cpp really makes them: its Q4_K_M and Q5_K_M
mixes (Q4_K / Q5_K with Q6_K for attn_v, ffn_down and the output head) and a Q4_1 (duet's default format). The model:
one layer, hidden 256 (the k-quants' super-block), intermediate 512, vocabulary 320, untied head, seed 3; written F32
by gguf_files.write_gguf, then `llama-quantize in out TYPE` (llama.cpp from bench/llamacpp/build.sh). ~0.5 MB each,
committed: CI has no llama.cpp.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "engine" / "loading" / "llamacpp_files"
TYPES = ("Q4_K_M", "Q5_K_M", "Q4_1")


def main() -> None:
    from engine.loading.tiny import make_tiny_model
    from tests.engine.loading.gguf_files import write_gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("--quantize", default=".cache/llama.cpp/build/bin/llama-quantize")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_model(Path(tmp) / "hf", arch="llama", vocab_size=320, hidden_size=256, num_layers=1,
                             num_heads=4, num_kv_heads=2, intermediate_size=512, seed=3)
        f32 = write_gguf(hf, Path(tmp) / "tiny.F32.gguf", "F32")
        OUT.mkdir(parents=True, exist_ok=True)
        for t in TYPES:
            subprocess.run([args.quantize, str(f32), str(OUT / f"tiny.{t}.gguf"), t], check=True,
                           capture_output=True)
            print(OUT / f"tiny.{t}.gguf")


if __name__ == "__main__":
    main()
