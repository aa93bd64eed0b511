"""LoRA with speculative decoding: the target verifies each request's drafts with its own adapter (the step's token
slots cover the drafted rows too: engine/model_runner.py), so greedy outputs are token for token those of the same
adapters without speculation, for proposers that know nothing of adapters (n-gram, suffix) and for a draft model
(the base model's own draft, run without the adapters: fewer drafts accepted, never other tokens). A batch mixes the
base model and two adapters on one slot each."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loading.tiny_draft import derive_draft
from engine.request import SamplingParams
from tests.engine.lora.peft_saved import save_peft_adapter

MODELS = [None, "ad-every", "ad-qv"]
SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
         "suffix": {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0},
         "draft_model": None}


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    model = tiny_model("llama")
    tmp = tmp_path_factory.mktemp("lora-spec")
    adapters = {"ad-every": str(save_peft_adapter(model, tmp / "every", seed=1, std=0.3, target_modules=(
                    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))),
                "ad-qv": str(save_peft_adapter(model, tmp / "qv", seed=2, std=0.3,
                                               target_modules=("q_proj", "v_proj")))}
    g = torch.Generator().manual_seed(3)
    prompts = []
    for n in (6, 14, 25):  # repeats, so the proposers find matches
        body = torch.randint(3, 400, (n,), generator=g).tolist()
        prompts += [body + body[: n // 2], (body[:4] * 6)[:n]]
    jobs = [(p, MODELS[i % 3]) for i, p in enumerate(prompts)]
    want = serve(Engine(EngineConfig(model=str(model), num_blocks=512, lora_modules=adapters)), jobs)
    return model, adapters, jobs, want, derive_draft(model, tmp / "draft", noise=0.05)


def serve(engine: Engine, jobs) -> list[list[int]]:
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=0.7, lora=lora)).request_id
        for p, lora in jobs]
    out = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[i] for i in ids]


@pytest.mark.parametrize("method", list(SPECS))
def test_speculation_with_adapters_gives_the_tokens_without(setup, method):
    model, adapters, jobs, want, draft = setup
    spec = SPECS[method] or {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    engine = Engine(EngineConfig(model=str(model), num_blocks=512, lora_modules=adapters, speculative_config=spec))
    engine.spec.cost.fit = lambda: None  # every draft proposed is verified
    assert all(len(set(w)) > 1 for w in want) and want[1] != want[0]  # the adapters change the outputs
    assert serve(engine, jobs) == want
    stats = engine.spec.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
