"""Issue 48, must-show 1, served: GPTQ, AWQ and compressed-tensors checkpoints (written by
tests/engine/loading/hf_quant_files.py: GPTQ 4 bits asymmetric with act-order, AWQ 4 bits, compressed-tensors W8A16
asymmetric by its own library; groups of 32) through `duet serve` — 1 prefill + 1 decode Ray actor, each prompt's KV
pulled over NIXL — with their weights kept packed in both workers (the C group kernels, as /v1/models says), greedy,
token for token with a dense engine on the same checkpoint dequantized at load (``quantized_weights: dense``), each
chosen token's logprob within ``LOGPROB_TOL`` of the dense engine's (the C GEMV sums in another order: within 1e-5 of
the logits' spread, tests/engine/loading/test_hf_quantized.py), through the official openai client. The decode
worker replays its decode steps from recordings of their C calls (no kernel fallback), act-order included. The CLI's
quantization flags reach the engine config. One server per checkpoint (a server serves one model), ~10 s each here."""
from __future__ import annotations

import signal
import sys

import openai
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from tests.cluster.serve_process import serve_worker_stats, serving
from tests.engine.loading.hf_quant_files import write_awq, write_compressed_tensors, write_gptq
from tests.engine.models.test_parity import random_prompts
from tests.ports import free_port

MAX_TOKENS = 16
LOGPROB_TOL = 1e-4
CHECKPOINTS = {  # name: (writer, its arguments, the projections' format in /v1/models)
    "gptq-int4-asym-g32-act-order": (write_gptq, {"bits": 4, "group_size": 32, "sym": False, "desc_act": True},
                                     "G4 g32 packed"),
    "awq-int4-g32": (write_awq, {"group_size": 32}, "G4 g32 packed"),
    "ct-w8a16-asym-g32": (write_compressed_tensors, {"bits": 8, "group_size": 32, "sym": False}, "G8 g32 packed"),
}
PROJECTIONS = ("attention qkv", "attention output", "mlp gate_up", "mlp down")


def test_quantization_flags_reach_the_engine_config():
    from cluster.cli import build_parser, engine_config_from_args, serve_config_from_args

    parse = build_parser().parse_args
    serve = serve_config_from_args(parse(["serve", "--model", "m", "--quantization", "int4",
                                          "--quantized-weights", "dense"])).engine
    assert (serve.quantization, serve.quantized_weights) == ("int4", "dense")
    assert serve_config_from_args(parse(["serve", "--model", "m"])).engine.quantization is None
    assert engine_config_from_args(parse(["generate", "--model", "m", "--quantization", "int8", "--prompt", "x"])
                                   ).quantization == "int8"


def dense_reference(path, prompts: list[list[int]]) -> tuple[list[list[str]], list[list[float]], list[str]]:
    """The dense engine's greedy tokens (as the API renders them), their logprobs and the texts."""
    engine = Engine(EngineConfig(model=str(path), num_blocks=64, kernels="cpu", quantized_weights="dense"))
    assert engine.runner.model.layers[0].mlp.down_proj.quant is None  # dense: the float weights
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    reqs = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    texts = {r.request_id: "" for r in reqs}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.new_text
    tokens = [[engine.tokenizer.decode([t], skip_special_tokens=False) for t in r.output_token_ids] for r in reqs]
    logprobs = [list(r.output_logprobs) for r in reqs]
    engine.close()
    return tokens, logprobs, [texts[r.request_id] for r in reqs]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_checkpoint_served_packed_equals_the_dense_engine(case, ray_session, tmp_path, tiny_model):
    writer, kw, fmt = CHECKPOINTS[case]
    path = writer(tiny_model("llama"), tmp_path / case, **kw)
    prompts = random_prompts(512, lens=(7, 21, 40), seed=5)
    want_tokens, want_logprobs, want_texts = dense_reference(path, prompts)
    port = free_port()
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(path), "--prefill", "1", "--decode", "1",
            "--local-prefill-max-tokens", "0", "--num-blocks", "160", "--max-model-len", "512", "--address",
            ray_session.get_runtime_context().gcs_address, "--port", str(port), "--grpc-port", str(free_port())]
    with serving(argv, tmp_path / "serve.log", port, signal.SIGINT):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=120)
        for prompt, tokens, logprobs, text in zip(prompts, want_tokens, want_logprobs, want_texts):
            got = client.completions.create(model=path.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=0, extra_body={"ignore_eos": True}).choices[0]
            assert got.logprobs.tokens == tokens and got.text == text
            assert max(abs(a - b) for a, b in zip(got.logprobs.token_logprobs, logprobs)) <= LOGPROB_TOL
        duet = client.models.retrieve(path.name).model_extra["duet"]
        stats = serve_worker_stats(ray_session)
    kinds = {w["kind"]: w for w in duet["weights"]}
    assert {kinds[k]["format"] for k in PROJECTIONS} == {fmt}
    assert all(kinds[k]["kernel"].startswith("C group GEMV") for k in PROJECTIONS)
    assert duet["kernels"] == "cpu" and duet["decode_graphs"].startswith("CPU recordings")
    assert stats["prefill-0"]["num_handoffs"] == len(prompts)
    assert stats["decode-0"]["num_remote_kv_received"] == len(prompts)
    assert stats["decode-0"]["kernel_fallbacks"] == 0  # every decode step recorded, act-order too
