"""Speculative decoding speed (issue 28 must-show 2): output tok/s with and without each proposer, in one run.

    python -m bench.engine.speculative [--small] [--model PATH] [--batches 1,4,16] [--max-tokens 128]
    make bench-spec [SMALL=1]

SmolLM2-135M-Instruct (the default GGUF) through the engine, greedy, chat template applied, on two workloads
(bench/engine/speculative_prompts.py): input-grounded (repeat / correct / summarise a given paragraph) and open chat.
For each workload and batch size B, each configuration — no speculation, ``ngram``, ``suffix`` — gets a fresh
engine (``max_num_seqs`` = B; a fresh suffix cache, so no proposer has seen the measured outputs), serves two
warm-up prompts, then the measured prompts in waves of B (batch 1: 4 prompts one at a time; B > 1: 2 waves,
16: one). Reported per cell: output tok/s, the speedup over no speculation measured in the same run, the mean
acceptance length (1 + accepted / drafts verified) and the acceptance rate per draft position, and whether the
outputs equal those without speculation (greedy: they must; a difference is printed with the target's top-two
logit gap where the paths part).

The speculation length is the engine's own choice per step (engine/speculative/policy.py); ``num_speculative_tokens``
is only its bound. Last line: ``ratio: <best proposer's speedup, batch 1, input-grounded>``; goals: >= 1.5
there, >= 0.97 everywhere.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.engine.speculative_prompts import prompts

METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


def run_cell(model: str, spec, texts: list[str], warm: list[str], batch: int, max_tokens: int) -> dict:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    engine = Engine(EngineConfig(model=model, speculative_config=spec, max_num_seqs=batch, max_model_len=4096))
    chat = [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in warm + texts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    engine.generate(chat[:len(warm)], params)
    measured = chat[len(warm):]
    outs, seconds = [], 0.0
    for w in range(0, len(measured), batch):
        t0 = time.perf_counter()
        outs += engine.generate(measured[w:w + batch], params)
        seconds += time.perf_counter() - t0
    tokens = sum(len(o["token_ids"]) for o in outs)
    cell = {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "outputs": [o["token_ids"] for o in outs]}
    if engine.spec is not None:
        st = engine.spec.stats
        drafts = max(st.num_drafts, 1)
        cell.update(acceptance_length=1 + st.num_accepted_tokens / drafts, num_drafts=st.num_drafts,
                    num_draft_tokens=st.num_draft_tokens, num_accepted_tokens=st.num_accepted_tokens,
                    acceptance_per_pos=[round(n / drafts, 3) for n in st.accepted_per_pos],
                    cost_fit=engine.spec.cost.fit())
    engine.close()
    return cell


def n_prompts(batch: int) -> int:
    return 4 if batch == 1 else (16 if batch >= 16 else 2 * batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct's GGUF)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workloads", default="input-grounded,open-chat")
    ap.add_argument("--paragraph-words", type=int, default=160, help="length of the input-grounded texts")
    ap.add_argument("--small", action="store_true", help="batches 1,4; 64 tokens")
    ap.add_argument("--out", default="build/bench/spec.json")
    args = ap.parse_args()
    if args.small:
        args.batches, args.max_tokens = "1,4", 64
    from engine.loading.default_model import default_model_path

    model = args.model or str(default_model_path())
    results = {}
    for workload in args.workloads.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            texts, warm = prompts(workload, n_prompts(batch), max_words=args.paragraph_words)
            base = None
            for name, spec in METHODS.items():
                cell = run_cell(model, spec, texts, warm, batch, args.max_tokens)
                if base is None:
                    base = cell
                cell["speedup"] = cell["tok_s"] / base["tok_s"]
                cell["equal_outputs"] = sum(a == b for a, b in zip(cell["outputs"], base["outputs"]))
                results[f"{workload}/b{batch}/{name}"] = cell
                extra = ""
                if spec is not None:
                    extra = (f"  accept-len {cell['acceptance_length']:.2f}  per-pos {cell['acceptance_per_pos']}"
                             f"  equal {cell['equal_outputs']}/{len(cell['outputs'])}")
                print(f"{workload:15s} b={batch:<3d} {name:7s} {cell['tok_s']:7.1f} tok/s  x{cell['speedup']:.2f}{extra}",
                      flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "outputs"}
                                          for k, v in results.items()}, indent=1))
    worst = min(v["speedup"] for k, v in results.items() if not k.endswith("/none"))
    unequal = sum(len(v["outputs"]) - v["equal_outputs"] for v in results.values())
    print(f"lowest speedup of any proposer anywhere: {worst:.2f}; greedy outputs different from no speculation: "
          f"{unequal}")
    b1 = [v["speedup"] for k, v in results.items() if k.startswith("input-grounded/b1/") and not k.endswith("none")]
    print(f"ratio: {max(b1):.2f}" if b1 else "ratio: n/a (input-grounded at batch 1 not run)")


if __name__ == "__main__":
    main()
