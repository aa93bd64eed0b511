"""Must-show 2 on the default model, through bench-llamacpp's own accounting (bench/llamacpp/engine_side.py
``resident_weight_bytes``): SmolLM2-135M-Instruct Q4_1 keeps every quantized tensor packed (Q4_1 projections, the
Q8_0 token table that is also the tied head, counted once), and what the engine keeps of the weights is within
1.15x of the file's tensor bytes."""
from __future__ import annotations

from bench.llamacpp.engine_side import resident_weight_bytes
from bench.llamacpp.models import file_tensor_bytes
from engine.config import EngineConfig
from engine.engine import Engine


def test_smollm2_q4_1_resident_weights_within_1_15x_of_the_file(smollm2_gguf):
    engine = Engine(EngineConfig(model=str(smollm2_gguf), num_blocks=16))
    resident = resident_weight_bytes(engine.runner.model)
    file_types = file_tensor_bytes(smollm2_gguf)
    assert set(file_types) == {"Q4_1", "Q8_0", "F32"}
    # 30 layers x (qkv, o, gate_up, down: the file's q/k/v and gate/up joined packed) and the token table, shared
    # with the tied head
    assert resident.packed_formats == {"Q4_1": 30 * 4, "Q8_0": 1}
    assert file_types["Q4_1"] + file_types["Q8_0"] <= resident.packed_bytes <= 1.15 * (file_types["Q4_1"] +
                                                                                         file_types["Q8_0"])
    assert resident.dense_bytes == file_types["F32"]  # the norms, nothing dequantized
    assert resident.total_bytes <= 1.15 * sum(file_types.values())
    engine.close()
