"""LoRA through the engine: a batch mixing the base model and two adapters written by peft, each request's greedy
tokens equal to transformers + peft with its adapter (the base: transformers alone), the chosen tokens' logprobs
within 1e-4 (fp32); and the adapter in the block-hash namespace (no prefix sharing across adapters)."""
from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError, InvalidRequestError, LoraAdapterError, LoraAdapterNotFoundError
from engine.request import SamplingParams
from tests.engine.lora.peft_saved import peft_reference, save_peft_adapter

NUM_TOKENS = 24
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def adapters_for(tiny_model, tmp_path_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = _write_adapters(tiny_model(arch), tmp_path_factory)
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def setup(adapters_for):
    return adapters_for("llama")


def _write_adapters(model, tmp_path_factory):
    adapters = {
        "every-proj": save_peft_adapter(model, tmp_path_factory.mktemp("a"), seed=1, r=4, lora_alpha=8,
                                        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj")),
        "qv-rslora": save_peft_adapter(model, tmp_path_factory.mktemp("b"), seed=2, r=8, lora_alpha=16,
                                       target_modules=("q_proj", "v_proj"), use_rslora=True, std=0.2),
    }
    return model, adapters


def _run(engine: Engine, prompts, loras):
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=0, lora=lora)).request_id
        for p, lora in zip(prompts, loras)]
    tokens = {i: [] for i in ids}
    logprobs = {i: [] for i in ids}
    cached = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp[0] if isinstance(lp, list) else lp for lp in out.new_logprobs]
            cached[out.request_id] = out.num_cached_tokens
    return [tokens[i] for i in ids], [logprobs[i] for i in ids], [cached[i] for i in ids]


def _reference(model, prompt, num_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    gen = out[0, len(prompt):].tolist()
    with torch.no_grad():
        logits = model(out).logits[0, len(prompt) - 1:-1].float()
    return gen, logits.log_softmax(-1).gather(1, torch.tensor(gen)[:, None])[:, 0].tolist()


# qwen2: q/k/v biases, tied embeddings; kernels auto on a CPU: the C kernels on packed weights (LoRA: kernels/cpu/
# lora.c), torch: torch GEMMs (LoRA: engine/lora/ops.py's torch forms), triton: the interpreter (LoRA: kernels/lora.py)
@pytest.mark.parametrize("arch, kernels", [("llama", "auto"), ("qwen2", "auto"), ("llama", "torch"),
                                           pytest.param("llama", "triton", marks=pytest.mark.slow)])
def test_mixed_batch_equals_transformers_and_peft(adapters_for, arch, kernels):
    model, adapters = adapters_for(arch)
    rng = random.Random(0)
    lens = (5, 17, 33, 9, 40, 2)
    loras = [None, "every-proj", "qv-rslora", "every-proj", "qv-rslora", None]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lens]
    engine = Engine(EngineConfig(model=str(model), num_blocks=256, lora_modules={k: str(v) for k, v in
                                 adapters.items()}, max_lora_rank=8, max_num_batched_tokens=64, kernels=kernels))
    ours, our_lps, _ = _run(engine, prompts, loras)
    assert engine.stats.num_steps < len(prompts) * NUM_TOKENS  # the requests really shared steps
    refs = {name: peft_reference(model, None if name is None else adapters[name]) for name in set(loras)}
    worst = 0.0
    for p, lora, toks, lps in zip(prompts, loras, ours, our_lps):
        want, want_lps = _reference(refs[lora], p, NUM_TOKENS)
        assert toks == want, f"adapter {lora}, prompt of {len(p)} tokens"
        worst = max(worst, max(abs(a - b) for a, b in zip(lps, want_lps)))
    assert worst < LOGPROB_ATOL, worst
    # the adapters change the model: each gives other tokens than the base on some prompt
    base_only, _ = _reference(refs[None], prompts[1], NUM_TOKENS)
    assert base_only != ours[1]
    assert _reference(refs[None], prompts[2], NUM_TOKENS)[0] != ours[2]


def test_bf16_slots_equal_peft_on_the_rounded_weights(setup):
    """lora_dtype bfloat16 on an fp32 model: the adapters' weights are rounded once to bf16 in the slots, the math stays
    fp32 (the kernels widen them exactly): tokens and log-probs are transformers + peft's with its LoRA weights rounded
    the same way."""
    model, adapters = setup
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 21, 12)]
    loras = ["every-proj", "qv-rslora", "every-proj"]
    engine = Engine(EngineConfig(model=str(model), num_blocks=256, lora_modules={k: str(v) for k, v in
                                 adapters.items()}, max_lora_rank=8, lora_dtype="bfloat16"))
    assert engine.runner.model.layers[0].self_attn.qkv_proj.lora.dtype == torch.bfloat16
    ours, our_lps, _ = _run(engine, prompts, loras)
    for p, lora, toks, lps in zip(prompts, loras, ours, our_lps):
        ref = peft_reference(model, adapters[lora])
        with torch.no_grad():
            for name, w in ref.named_parameters():
                if "lora_" in name:
                    w.copy_(w.bfloat16().float())
        want, want_lps = _reference(ref, p, NUM_TOKENS)
        assert toks == want, lora
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < LOGPROB_ATOL
    with pytest.raises(ConfigError, match="lora_dtype bfloat16 on a float32 model needs a LoRA kernel"):
        Engine(EngineConfig(model=str(model), num_blocks=64, kernels="torch", lora_dtype="bfloat16",
                            lora_modules={"a": str(adapters["every-proj"])}))
    with pytest.raises(ConfigError, match="lora_dtype must be one of"):
        EngineConfig(model=str(model), lora_dtype="int8")


def test_adapters_never_share_cached_blocks(setup):
    model, adapters = setup
    engine = Engine(EngineConfig(model=str(model), num_blocks=256, lora_modules={k: str(v) for k, v in
                                 adapters.items()}, max_lora_rank=8))
    prompt = list(range(10, 10 + 64))  # 4 full blocks of 16
    cached = [_run(engine, [prompt], [lora])[2][0] for lora in ("every-proj", "every-proj", "qv-rslora", None, None)]
    assert cached == [0, 48, 0, 0, 48]  # the last block is recomputed for its logits


def test_unknown_adapter_and_bad_config_are_refused(setup):
    model, adapters = setup
    engine = Engine(EngineConfig(model=str(model), num_blocks=64, lora_modules={"a": str(adapters["every-proj"])}))
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'zzz'"):
        engine.add_request(prompt_token_ids=[5, 6], params=SamplingParams(lora="zzz"))
    with pytest.raises(ConfigError, match="max_cpu_loras 1 must be >= max_loras 1 and >= the 2 lora_modules"):
        EngineConfig(model=str(model), lora_modules={k: str(v) for k, v in adapters.items()}, max_loras=1,
                     max_cpu_loras=1)
    with pytest.raises(ConfigError, match="pinned_loras \\['zz'\\] are not lora_modules"):
        EngineConfig(model=str(model), lora_modules={"a": "/x"}, pinned_loras=["zz"])
    with pytest.raises(ConfigError, match="1 pinned_loras leave no slot of max_loras 1"):
        EngineConfig(model=str(model), lora_modules={"a": "/x", "b": "/y"}, max_loras=1, pinned_loras=["a"])
    with pytest.raises(Exception, match="rank 8 > max_lora_rank 4"):
        Engine(EngineConfig(model=str(model), num_blocks=64, max_lora_rank=4,
                            lora_modules={"b": str(adapters["qv-rslora"])}))


def test_load_and_unload_at_run_time(setup):
    model, adapters = setup
    prompt = list(range(20, 45))
    pinned = Engine(EngineConfig(model=str(model), num_blocks=128, lora_modules={k: str(v) for k, v in
                                 adapters.items()}, max_lora_rank=8))
    want = {name: _run(pinned, [prompt], [name])[0][0] for name in adapters}
    engine = Engine(EngineConfig(model=str(model), num_blocks=128, max_loras=1, max_lora_rank=8))
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'every-proj'"):
        engine.add_request(prompt_token_ids=prompt, params=SamplingParams(lora="every-proj"))
    digest = engine.load_lora("every-proj", str(adapters["every-proj"]))
    assert digest == engine.runner.lora.digest("every-proj") and engine.runner.lora.slots.slot_of == {"every-proj": 0}
    with pytest.raises(LoraAdapterError, match="already loaded"):
        engine.load_lora("every-proj", str(adapters["every-proj"]))
    with pytest.raises(LoraAdapterError, match="max_cpu_loras: 1 LoRA adapters are loaded"):
        engine.load_lora("qv-rslora", str(adapters["qv-rslora"]))
    with pytest.raises(LoraAdapterNotFoundError, match="no LoRA adapter directory at /no/such"):
        engine.load_lora("x", "/no/such")
    engine.add_request(request_id="r", prompt_token_ids=prompt, params=SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, lora="every-proj"))
    engine.step()
    with pytest.raises(InvalidRequestError, match="in use by 1 requests"):
        engine.unload_lora("every-proj")
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == NUM_TOKENS - 1  # the first token came with the step above
    engine.unload_lora("every-proj")
    with pytest.raises(LoraAdapterNotFoundError, match="'every-proj' is not loaded"):
        engine.unload_lora("every-proj")
    with pytest.raises(LoraAdapterError, match="served with other weights before"):
        engine.load_lora("every-proj", str(adapters["qv-rslora"]))
    engine.load_lora("qv-rslora", str(adapters["qv-rslora"]))
    assert engine.runner.lora.slots.slot_of == {"qv-rslora": 0}  # the freed slot, overwritten
    assert _run(engine, [prompt], ["qv-rslora"])[0][0] == want["qv-rslora"]
    assert want["qv-rslora"] != want["every-proj"]
