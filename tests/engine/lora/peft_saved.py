"""Adapters written by ``peft`` itself (the reference nobody here wrote) on a tiny checkpoint, with random
``lora_B`` (``init_lora_weights=False``: PEFT's default zero ``B`` would make every adapter the base model)."""
from __future__ import annotations

from pathlib import Path

import peft  # a test dependency (pip install .[test])
import torch
import transformers

from tests.engine.loading.hf_saved import hf_reference


def save_peft_adapter(model_dir: Path, out_dir: Path, *, seed: int, r: int = 4, lora_alpha: float = 8,
                      target_modules=("q_proj", "v_proj", "down_proj"), use_rslora: bool = False,
                      std: float = 0.1) -> Path:
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                          init_lora_weights=False)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def peft_reference(model_dir: Path, adapter_dir: Path | None):
    """transformers (eager attention, fp32) + peft with the adapter; None: the base model alone."""
    base = hf_reference(model_dir)
    return base if adapter_dir is None else peft.PeftModel.from_pretrained(base, adapter_dir).eval()
