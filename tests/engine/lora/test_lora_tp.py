"""LoRA under tensor parallelism (engine/lora/pool.py): an engine over 2 gloo ranks with adapters on every projection
gives the one-rank engine's greedy tokens, with logprobs within the tensor-parallel tolerance of
tests/engine/models/test_tensor_parallel.py (1e-4; the row-parallel projections' deltas are partial sums added by the
all-reduce). One slot for three adapters, one loaded at run time: rank 0's slot writes reach the other rank between
steps, and the step's token slots travel with the step. The one-rank engine is itself held equal to transformers +
peft (test_lora_engine.py)."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from tests.engine.lora.peft_saved import save_peft_adapter
from tests.engine.models.test_tensor_parallel import assert_same
from tests.engine.models.test_tensor_parallel import run as run_tp
from tests.engine.tp_engines import tp_engine

pytestmark = pytest.mark.slow
PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 160, 2)), list(range(30, 52)), list(range(60, 99))]
MODELS = [None, "ad-every", "ad-qv", "ad-late", "ad-every"]


def run(engine: Engine) -> list[dict]:
    return run_tp(engine, PROMPTS, [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2,
                                                   prompt_logprobs=1, lora=lora) for lora in MODELS])


def test_two_ranks_with_adapters_give_the_one_rank_engine_s_tokens(tiny_model, tmp_path):
    model = tiny_model("llama", num_heads=4, num_kv_heads=2, vocab_size=511)
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = {"ad-every": str(save_peft_adapter(model, tmp_path / "every", seed=1, r=8, target_modules=every,
                                                  std=0.3)),
                "ad-qv": str(save_peft_adapter(model, tmp_path / "qv", seed=2, target_modules=("q_proj", "v_proj"),
                                               std=0.3))}
    late = str(save_peft_adapter(model, tmp_path / "late", seed=3, target_modules=("o_proj", "down_proj"), std=0.3))
    config = EngineConfig(model=str(model), num_blocks=64, block_size=8, lora_modules=adapters, max_loras=1,
                          max_cpu_loras=3)
    one = Engine(config)
    one.load_lora("ad-late", late)
    want = run(one)
    assert [w["tokens"] for w in want[1:3]] != [want[0]["tokens"]] * 2  # the adapters change the output
    with tp_engine(config, 2) as engine:
        engine.load_lora("ad-late", late)  # at run time: its slot writes are sent to the other rank
        assert_same(run(engine), want)
        assert engine.lora_stats()["evictions"] >= 2  # one slot, three adapters: written again at run time
