"""LoRA on a packed (GGUF Q4_1) base whose decode steps replay from CPU recordings (engine/decode_graphs.py): the
per-token adapter slots are an input of the recorded step (a static buffer refilled every step), so batches that
mix the base and two adapters, and change as requests finish, give the eager engine's tokens (log-probs to float
rounding, as the recordings of the base model alone: tests/engine/test_cpu_decode_recordings.py), and the adapters
really apply (other tokens than the base). A replayed step checks its LoRA slots."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from tests.engine.loading.gguf_files import write_gguf
from tests.engine.lora.peft_saved import save_peft_adapter
from tests.engine.test_decode_graphs import MAX_TOKENS, PROMPTS

LORAS = ["a", None, "b", "a", "b"]


@pytest.fixture(scope="module")
def packed_with_adapters(tiny_model, tmp_path_factory):
    model = tiny_model("llama")
    gguf = write_gguf(model, tmp_path_factory.mktemp("lora-rec") / "t.Q4_1.gguf", "Q4_1")
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = {"a": save_peft_adapter(model, tmp_path_factory.mktemp("a"), seed=1, r=4, target_modules=every),
                "b": save_peft_adapter(model, tmp_path_factory.mktemp("b"), seed=2, r=8, lora_alpha=16)}
    return gguf, {k: str(v) for k, v in adapters.items()}


def engine(gguf, adapters, graphs: int) -> Engine:
    return Engine(EngineConfig(model=str(gguf), num_blocks=64, dtype="float32", kernels="cpu", max_num_seqs=8,
                               cpu_graph_max_batch=graphs, lora_modules=adapters, max_lora_rank=8))


def run(e: Engine, loras) -> list[tuple[list[int], list[float]]]:
    ids = [e.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=m, temperature=0, ignore_eos=True,
                                                                   logprobs=0, lora=lo)).request_id
           for p, m, lo in zip(PROMPTS, MAX_TOKENS, loras)]
    got = {i: ([], []) for i in ids}
    while e.has_unfinished_requests():
        for out in e.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_logprobs)
    return [got[i] for i in ids]


def test_recorded_decode_with_adapters_equals_eager(packed_with_adapters):
    gguf, adapters = packed_with_adapters
    eager, recorded = engine(gguf, adapters, 0), engine(gguf, adapters, 8)
    assert eager.runner.decode_graphs is None and recorded.runner.fallbacks == []
    want, got = run(eager, LORAS), run(recorded, LORAS)
    graphs = recorded.runner.decode_graphs
    assert {b for b, (rec, _) in graphs.graphs.items() if rec is not None} == {1, 2, 4, 8}  # batches 5 .. 1
    assert graphs.replays >= max(MAX_TOKENS) - 1
    calls = [fn.__name__ for fn, _ in graphs.graphs[8][0].calls]
    assert calls.count("duet_lora_packed_f32") == 4 * recorded.model_config.num_layers  # every projection's adapters
    for k, (mine, theirs) in enumerate(zip(got, want)):
        assert mine[0] == theirs[0], k
        torch.testing.assert_close(torch.tensor(mine[1]), torch.tensor(theirs[1]), rtol=0, atol=1e-4)
    base = run(recorded, [None] * len(PROMPTS))  # the same recordings, every row on the base model now
    assert [t for t, _ in base] == [t for t, _ in run(eager, [None] * len(PROMPTS))]
    assert all(base[k][0] != got[k][0] for k, lo in enumerate(LORAS) if lo is not None)  # the adapters applied


def test_a_replayed_step_checks_its_lora_slots(packed_with_adapters):
    gguf, adapters = packed_with_adapters
    e = engine(gguf, adapters, 4)
    run(e, LORAS)
    with pytest.raises(ValueError, match=r"LoRA slots must be in \[-1, 2\)"):
        e.runner.decode_graphs.run([5], [3], [40], [[2]], [4], [2])
