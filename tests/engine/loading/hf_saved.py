"""Checkpoints written by transformers itself (``save_pretrained``, i.e. today's on-disk format: transformers 5
writes ``rope_parameters`` and ``dtype``), with random weights scaled like engine/loading/tiny.py's so that greedy
decoding has no near-ties, and the tokenizer files of a tiny model (transformers does not train one)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_with_transformers(out: str | Path, config: transformers.PretrainedConfig, tokenizer_dir: str | Path,
                           seed: int = 0) -> Path:
    out = Path(out)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_((0.02 if config.tie_word_embeddings else 0.4) * noise)
            elif "lm_head" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(1.5 * noise / p.shape[1] ** 0.5)
        if config.tie_word_embeddings:
            model.model.norm.weight.mul_(12.5)
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out


def hf_reference(where: str | Path, dtype: torch.dtype = torch.float32, **kw) -> transformers.PreTrainedModel:
    """transformers' model of ``where`` as the reference, on its eager attention: transformers' SDPA path drops
    Gemma 2's attention soft-cap (5.17 chose SDPA for Gemma 2 by default and gave other logits than 5.24, which
    chooses eager; seen on a GPU machine's image), and eager is transformers' own definition for every family."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(where), dtype=dtype, attn_implementation="eager",
                                                             **kw).eval()
