"""vLLM CPU's offline engine on make bench-engine's workload; runs inside vLLM's own venv (bench/install_vllm.sh).

    .cache/vllm-venv/bin/python bench/engine/vllm_offline.py WORKLOAD.json RESULT.json

WORKLOAD.json: {"model": HF dir, "requests": [[prompt ids, output tokens], ...], "kv_cache_gib": int,
"repeats": int}. Each request is a ``TokensPrompt`` (the same ids duet and transformers get), greedy, EOS
ignored, ``max_tokens`` = its output length. One warm-up, then ``repeats`` timed ``LLM.generate`` calls of the
whole batch; RESULT.json gets every run's seconds and output tokens. vLLM spawns worker processes, so the
work is guarded by ``if __name__ == "__main__"``. Prefix caching is off, as for duet (random prompts).
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    workload = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(workload.get("kv_cache_gib", 1)))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reqs = workload["requests"]
    max_len = max(len(p) + o for p, o in reqs) + 16
    llm = LLM(model=workload["model"], dtype="float32", max_model_len=max(max_len, 1024),
              enable_prefix_caching=False, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, temperature=0)] * 2, use_tqdm=False)  # warm-up
    runs = []
    for _ in range(workload.get("repeats", 1)):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append({"seconds": time.perf_counter() - t0,
                     "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)})
    with open(sys.argv[2], "w") as f:
        json.dump({"runs": runs, "vllm_version": __import__("vllm").__version__}, f)


if __name__ == "__main__":
    main()
