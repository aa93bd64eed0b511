"""make bench-engine's FLOP count: the MFU it reports is only as right as this."""
from __future__ import annotations

import torch

from bench.engine.throughput import workload_flops
from engine.config import EngineConfig
from engine.engine import Engine


def test_flops_equal_twice_the_layer_weights_plus_attention_and_lm_head(tiny_model):
    # the torch backend keeps the weights dense (the CPU path packs them for oneDNN) to count them
    engine = Engine(EngineConfig(model=str(tiny_model("llama")), num_blocks=16, kernels="torch"))
    cfg = engine.model_config
    layer_weights = sum(m.weight.numel() for layer in engine.runner.model.layers for m in layer.modules()
                        if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2)
    q = cfg.num_heads * cfg.head_dim
    # one request: a 3-token prompt and 2 outputs -> 4 tokens through the layers, contexts 1 + 2 + 3 + 4
    want = 2 * layer_weights * 4 + cfg.num_layers * 4 * q * 10 + 2 * 2 * cfg.hidden_size * cfg.vocab_size
    assert workload_flops(cfg, [([5, 6, 7], 2)]) == want


def test_quantized_rows_compare_the_packed_gguf_with_its_weights_dequantized():
    from bench.engine.throughput import quantized_sides

    assert quantized_sides(None, duet_runs_gguf=False) == {}  # an HF directory or the tiny model: no rows
    beside_hf = quantized_sides("m.gguf", duet_runs_gguf=False)  # vLLM's run: duet's main row is the fp32 directory
    assert beside_hf == {"duet, GGUF packed (fp32 activations)": {"model": "m.gguf"},
                         "duet, GGUF packed (int8 activations)": {"model": "m.gguf", "quantized_activations": "int8"},
                         "duet, GGUF dequantized at load (fp32)": {"model": "m.gguf", "quantized_weights": "dense"}}
    assert list(quantized_sides("m.gguf", duet_runs_gguf=True)) == list(beside_hf)[1:]  # main row is packed fp32
