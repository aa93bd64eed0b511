"""Draft checkpoints derived from another checkpoint, for speculative decoding's tests and benchmarks
(engine/speculative/draft.py): the same tokenizer files, the first layers, every weight perturbed.

Two tiny random checkpoints of different seeds agree on almost no greedy token (their logits are unrelated), so a
draft model built that way is rejected nearly always. A *derived* draft — the target's weights plus noise, or the
target cut to its first layers (a layer-skip draft) — agrees with the target often but not always: what tests of
acceptance and rejection need, and what a real distilled draft looks like to the engine. Like engine/loading/tiny.py it
imports no ``transformers``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def derive_draft(src: str | Path, out_dir: str | Path, *, num_layers: int | None = None, noise: float = 0.0,
                 seed: int = 0) -> Path:
    """A draft of the Hugging Face checkpoint directory ``src`` in ``out_dir``: its non-weight files copied, its
    first ``num_layers`` decoder layers (default: all), each weight tensor w plus ``noise * std(w)`` times
    standard Gaussian noise (numpy's PCG64 from ``seed``, tensors in name order), as one ``model.safetensors``."""
    src, out = Path(src), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    n = config["num_hidden_layers"] if num_layers is None else num_layers
    if not 1 <= n <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}")
    config["num_hidden_layers"] = n
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:n]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    rng = np.random.Generator(np.random.PCG64(seed))
    kept = {}
    for name in sorted(weights):
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= n:
            continue
        w = weights[name]
        if noise:
            x = w.float()
            x = x + noise * x.std() * torch.from_numpy(rng.standard_normal(tuple(w.shape)).astype(np.float32))
            w = x.to(w.dtype)
        kept[name] = w.contiguous()
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
