"""A PEFT LoRA adapter directory → ``LoraAdapter``: per decoder layer and per duet linear (the fused ``qkv_proj`` /
``gate_up_proj``, ``o_proj``, ``down_proj``), each shard's ``A`` [r, in] and ``B`` [out_shard, r], and the
adapter's ``scaling`` (``lora_alpha / r``; ``use_rslora``: ``lora_alpha / sqrt(r)``), applied after the expand as
PEFT does (``lora_B(lora_A(x)) * scaling``).

PEFT saves ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` (``lora_B`` alike); the HF
projection names map onto duet's fused parameters as the checkpoint loader maps them (``CausalLM.stacked_params``;
tests/engine/lora/test_adapter.py keeps the two in step). Only what duet implements is accepted: plain LoRA
(``peft_type`` LORA) on the attention and MLP projections of the dense decoder layers, ``bias`` "none". DoRA,
``modules_to_save``, embedding or LM-head targets, per-module rank / alpha patterns, ``fan_in_fan_out``, LoRA biases,
layer replication and the other PEFT variants are refused with an error (``engine.errors.LoraAdapterError``) that
names the field; so is a tensor the table does not place. No directory at the path: ``LoraAdapterNotFoundError``.
A path that does not exist but reads as a Hub id (``org/name[@revision]``) is the adapter's repository on the Hub:
its two files fetched into the Hugging Face cache (engine/hub/resolve.py ``resolve_adapter``; the launcher and the
router pin it to a commit first, ``pin_adapter``, so every worker reads the same bytes); what the Hub refuses is a
``LoraAdapterError`` naming why (no network and not cached, a gated or unknown repository, no adapter files).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file

from engine.errors import LoraAdapterError, LoraAdapterNotFoundError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the HF projections an adapter may target → (duet's linear, shard index in it; None: not fused)
PROJECTIONS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", None),
}
_KEY = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# config fields whose non-empty / true value asks for something duet does not implement
_REFUSED = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "fan_in_fan_out", "lora_bias",
            "layer_replication", "target_parameters", "trainable_token_indices", "use_qalora", "use_bdlora",
            "alora_invocation_tokens", "arrow_config", "megatron_config", "exclude_modules")


@dataclass(frozen=True)
class LoraShard:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features of the shard, rank]


@dataclass
class LoraAdapter:
    name: str
    path: Path
    rank: int
    scaling: float
    digest: str  # xxh3-128 of adapter_config.json and adapter_model.safetensors: the same name must mean these bytes
    # (layer index, duet linear e.g. "self_attn.qkv_proj") → {shard index or None: LoraShard}
    weights: dict[tuple[int, str], dict[int | None, LoraShard]] = field(default_factory=dict)

    def linears(self) -> list[tuple[int, str]]:
        return sorted(self.weights)


def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise LoraAdapterNotFoundError(f"no LoRA adapter directory at {path}")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise LoraAdapterError(f"{path}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{cfg_path}: peft_type {cfg['peft_type']!r} is not supported (only LORA)")
    for key in _REFUSED:
        if cfg.get(key):
            raise LoraAdapterError(f"{cfg_path}: {key}={cfg[key]!r} is not supported by duet's LoRA")
    if cfg.get("bias", "none") != "none":
        raise LoraAdapterError(f"{cfg_path}: bias={cfg['bias']!r} is not supported (only 'none')")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):  # a string is a regex over module names: the saved tensors are checked instead
        unknown = sorted(set(targets) - set(PROJECTIONS))
        if unknown:
            raise LoraAdapterError(f"{cfg_path}: target_modules {unknown} are not supported (duet applies LoRA to "
                                   f"{sorted(PROJECTIONS)})")
    r = cfg.get("r")
    if not isinstance(r, int) or r <= 0:
        raise LoraAdapterError(f"{cfg_path}: r must be a positive integer, got {r!r}")
    if not isinstance(cfg.get("lora_alpha"), (int, float)):
        raise LoraAdapterError(f"{cfg_path}: lora_alpha must be a number, got {cfg.get('lora_alpha')!r}")
    return cfg


def scaling_of(cfg: dict) -> float:
    """PEFT's ``LoraLayer.scaling``: alpha / r, or alpha / sqrt(r) with ``use_rslora``."""
    r, alpha = cfg["r"], cfg["lora_alpha"]
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def local_adapter(path: str | Path) -> Path:
    """``path``'s directory: itself, or a Hub id's snapshot in the Hugging Face cache (fetched if missing)."""
    from engine.hub.ref import is_hub_id

    if not is_hub_id(path):
        return Path(path)
    from engine.errors import ModelLoadError
    from engine.hub.resolve import resolve_adapter

    try:
        return resolve_adapter(path)
    except ModelLoadError as e:
        raise LoraAdapterError(f"LoRA adapter {path}: {e}") from None


def load_adapter(name: str, path: str | Path, num_layers: int | None = None) -> LoraAdapter:
    """Read the adapter at ``path`` (a directory, or a Hub id: ``local_adapter``; CPU tensors, the file's dtype).
    ``num_layers``: the base model's, checked."""
    path = local_adapter(path)
    cfg = read_config(path)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        pickle = (path / "adapter_model.bin").exists()
        bin_note = " (adapter_model.bin is a pickle: duet never loads pickles)" if pickle else ""
        raise LoraAdapterError(f"{path}: no {WEIGHTS_FILE}{bin_note}")
    h = xxhash.xxh3_128()
    for f in (path / CONFIG_FILE, weights_path):
        h.update(f.read_bytes())
    tensors = load_file(str(weights_path))
    rank, scaling = cfg["r"], scaling_of(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in PROJECTIONS:
            raise LoraAdapterError(f"{weights_path}: tensor {key!r} is not a LoRA weight of a supported projection "
                                   f"({sorted(PROJECTIONS)} of the decoder layers)")
        layer = int(m.group(1))
        if num_layers is not None and layer >= num_layers:
            raise LoraAdapterError(f"{weights_path}: tensor {key!r} names layer {layer}; the base has {num_layers}")
        pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = t
    adapter = LoraAdapter(name=name, path=path, rank=rank, scaling=scaling, digest=h.hexdigest())
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraAdapterError(f"{weights_path}: layer {layer} {proj} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraAdapterError(f"{weights_path}: layer {layer} {proj}: lora_A {tuple(a.shape)} / lora_B "
                                   f"{tuple(b.shape)} do not have rank r={rank}")
        linear, shard = PROJECTIONS[proj]
        adapter.weights.setdefault((layer, linear), {})[shard] = LoraShard(a=a, b=b)
    if not adapter.weights:
        raise LoraAdapterError(f"{weights_path}: no LoRA tensors")
    return adapter
