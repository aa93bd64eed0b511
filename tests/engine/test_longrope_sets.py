"""LongRoPE's factor set chosen per request (issue 46): short when prompt + max_tokens stay within the
pre-training length L0, long otherwise (engine/request.py ``admit_rope_factors``), on a model served at 4x L0.

- A batch mixing both sets runs each request with its own set, in the same steps, on every kernel backend
  (torch, C, Triton in the interpreter), token-exact with transformers on both sides of L0: a request within L0
  (transformers: short throughout) and one whose prompt alone passes L0 (transformers: long from the first
  forward on).
- A request whose prompt is within L0 but whose reach is not takes the long set throughout (where duet departs
  from transformers, which switches mid-generation): equal to transformers held to the long set.
- The long set is part of the block-hash salt: a prompt cached under one set is a prefix hit for the same set
  only.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError, InvalidRequestError
from engine.request import LONG_ROPE_SALT, SamplingParams, admit_rope_factors
from tests.engine.loading.hf_saved import save_with_transformers
from tests.engine.models.test_kernel_backends import DEVICE
from tests.engine.models.test_parity import hf_greedy, random_prompts

ORIGINAL = 64  # L0; the checkpoint's context is 4x that
NUM_TOKENS = 20
SHORT_LENS, LONG_LENS, CROSSING_LEN = (9, 40), (ORIGINAL + 3, 100), 50  # 50 + 20 > 64: long, prompt within L0


def phi3_longrope(original: int = ORIGINAL) -> transformers.Phi3Config:
    """Whole-head Phi-3 LongRoPE, distinct short and long factors, the context 4x the pre-training length."""
    half = 64 // 4 // 2
    return transformers.Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * original,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                   original_max_position_embeddings=original,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                                    "long_factor": [2.0 + 0.5 * i for i in range(half)],
                                                    "original_max_position_embeddings": original})


def hf_greedy_long_set(model_dir, prompts, num_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens with its Phi-3 RoPE held to the long factors from the first position on: the same
    checkpoint, its config's short factors replaced by the long ones (the attention factor depends on neither), so
    whichever set transformers' per-forward switch picks is the long one, in every transformers version."""
    src = Path(model_dir)
    dst = src.parent / f"{src.name}-long-set"
    if not dst.exists():
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(cfg.get(key), dict) and "long_factor" in cfg[key]:
                cfg[key]["short_factor"] = cfg[key]["long_factor"]
        (dst / "config.json").write_text(json.dumps(cfg))
    return hf_greedy(dst, prompts, num_tokens=num_tokens)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, tiny_model):
    return save_with_transformers(tmp_path_factory.mktemp("phi3-longrope"), phi3_longrope(), tiny_model("llama"))


def test_the_set_is_chosen_from_the_requests_reach():
    short = admit_rope_factors(SamplingParams(max_tokens=14), 50, 64)
    long = admit_rope_factors(SamplingParams(max_tokens=15), 50, 64)
    assert (short.rope_factors, long.rope_factors) == ("short", "long")  # 64 is within, 65 is not
    assert admit_rope_factors(long, 1, 64).rope_factors == "long"  # chosen once: kept by whoever sees it next
    assert admit_rope_factors(SamplingParams(max_tokens=15), 50, None).rope_factors is None  # no LongRoPE
    with pytest.raises(InvalidRequestError, match="for a model without LongRoPE"):
        admit_rope_factors(long, 50, None)
    with pytest.raises(InvalidRequestError, match="rope_factors must be one of short, long"):
        SamplingParams(rope_factors="medium").validate()
    # the short set hashes as a model without LongRoPE; the long one in its own namespace, salted or not
    assert short.hash_salt == SamplingParams().hash_salt == ()
    assert long.hash_salt == ("", "", LONG_ROPE_SALT)
    salted = SamplingParams(cache_salt="a", rope_factors="long")
    assert salted.hash_salt == ("", "a", LONG_ROPE_SALT) != SamplingParams(cache_salt="a").hash_salt


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["torch", "cpu", "triton"])
def test_a_batch_mixing_both_sets_equals_transformers(phi3_dir, kernels):
    prompts = random_prompts(512, lens=SHORT_LENS + LONG_LENS + (CROSSING_LEN,))
    engine = Engine(EngineConfig(model=str(phi3_dir), num_blocks=128, max_num_batched_tokens=512, dtype="float32",
                                 kernels=kernels, device=DEVICE if kernels == "triton" else "cpu"))
    assert engine.runner.ops.name == kernels and engine.max_model_len == 4 * ORIGINAL
    rows_per_step = []
    forward = engine.runner.forward
    engine.runner.forward = lambda ids, positions, *rest, **kw: (rows_per_step.append(list(positions)),
                                                                 forward(ids, positions, *rest, **kw))[1]
    got = engine.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    ours = [r["token_ids"] for r in got]
    # one step rotated rows of both tables: [0, L0) the short set's, [L0, ...) the long set's
    assert any(min(rows) < ORIGINAL <= max(rows) for rows in rows_per_step if len(rows) == len(prompts))
    n_short, n_long = len(SHORT_LENS), len(LONG_LENS)
    ref = hf_greedy(phi3_dir, prompts[:n_short + n_long], num_tokens=NUM_TOKENS)
    assert ours[:n_short + n_long] == ref
    crossing_ref = hf_greedy_long_set(phi3_dir, prompts[-1:], NUM_TOKENS)
    assert ours[-1] == crossing_ref[0]
    if kernels == "torch":  # the departure is real: transformers' own switch mid-generation gives other tokens
        assert hf_greedy(phi3_dir, prompts[-1:], num_tokens=NUM_TOKENS)[0] != crossing_ref[0]


@pytest.mark.slow
def test_prefix_hits_stay_within_a_factor_set(phi3_dir):
    prompt = random_prompts(512, lens=(48,))[0]  # 3 full blocks of 16
    engine = Engine(EngineConfig(model=str(phi3_dir), num_blocks=64, dtype="float32", kernels="cpu"))

    def run(max_tokens: int) -> tuple[str, int]:
        r = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                              ignore_eos=True))
        cached = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if cached is None and out.new_token_ids:
                    cached = out.num_cached_tokens
        return r.params.rope_factors, cached

    assert run(8) == ("short", 0)
    assert run(16) == ("short", 32)  # 48 + 16 = 64: still short; the prompt's cached blocks (the last recomputed)
    assert run(17) == ("long", 0)  # 65: long, the short set's blocks are no hit
    assert run(40) == ("long", 32)


@pytest.mark.slow
def test_a_draft_model_runs_each_request_in_its_set(phi3_dir):
    """Speculative decoding with a LongRoPE draft (the target itself: every draft it proposes is the target's own
    greedy choice only if it rotates with the request's set, so the acceptance rate shows a mismatch) and a
    batch mixing both sets: the tokens of plain greedy, and every draft accepted."""
    prompts = random_prompts(512, lens=SHORT_LENS + LONG_LENS + (CROSSING_LEN,))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(phi3_dir), num_blocks=128, dtype="float32", kernels="cpu"))
    spec = Engine(EngineConfig(model=str(phi3_dir), num_blocks=128, dtype="float32", kernels="cpu",
                               speculative_config={"method": "draft_model", "model": str(phi3_dir),
                                                   "num_speculative_tokens": 3}))
    assert [r["token_ids"] for r in spec.generate(prompts, params)] == \
        [r["token_ids"] for r in plain.generate(prompts, params)]
    stats = spec.spec.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_draft_with_another_pre_training_length_is_refused(phi3_dir, tmp_path, tiny_model):
    other = save_with_transformers(tmp_path / "other", phi3_longrope(original=32), tiny_model("llama"))
    with pytest.raises(ConfigError, match="LongRoPE pre-training length 32 differs from the target's 64"):
        Engine(EngineConfig(model=str(phi3_dir), num_blocks=64, dtype="float32", kernels="cpu", max_model_len=128,
                            speculative_config={"method": "draft_model", "model": str(other),
                                                "num_speculative_tokens": 2}))


@pytest.mark.slow
def test_tensor_parallel_ranks_rotate_with_the_requests_sets(phi3_dir):
    """Two ranks (heads split; rank 1 in its own process) run rank 0's table rows: the tokens of one engine on the
    batch mixing both sets."""
    from tests.engine.tp_engines import tp_engine

    prompts = random_prompts(512, lens=SHORT_LENS + LONG_LENS + (CROSSING_LEN,))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    config = EngineConfig(model=str(phi3_dir), num_blocks=128, dtype="float32", kernels="cpu")
    want = [r["token_ids"] for r in Engine(config).generate(prompts, params)]
    with tp_engine(config, 2) as engine:
        assert [r["token_ids"] for r in engine.generate(prompts, params)] == want
