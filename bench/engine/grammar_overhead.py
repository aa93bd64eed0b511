"""Grammar libraries for structured output, measured on SmolLM2's tokenizer (49,152 ids): the cost of building
the tokenizer index, of compiling a JSON schema, and per generated token of (next-token mask + applying it to
a [vocab] fp32 logits row + accepting the token) while replaying a valid compact JSON document token by token.

    python -m bench.engine.grammar_overhead [--reps N] [--compile-reps N] [--engine]

``--engine`` adds the end-to-end cost inside duet's engine on the real model: 8 concurrent chat requests with a
json_schema, then the same prompts unconstrained with each request's output length fixed to the constrained
one's (ignore_eos, max_tokens), so both runs generate the same number of tokens in the same batch shapes;
the ratio of their per-token times is the overhead (the grammar + everything around it in the sampler).

Benchmarks whichever of llguidance (what engine/sampling/structured.py uses), xgrammar and outlines-core are installed
and says which are missing. Every library's mask goes through the same apply (engine.sampling.structured's
``apply_token_bitmask_``: a 0 / -inf bias per mask byte, added), so the columns differ only by the library. Times
are thread CPU time (what a quiet core would see; the dev VM is shared) and, for the per-token total, wall.
Whitespace is compact for every library (``,`` and ``:``, no free whitespace) so all replay the same ids;
xgrammar's json_object uses its builtin JSON grammar (its compact ``{"type": "object"}`` rejects a second
property with custom separators in 0.2.8).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from engine.loading.checkpoint import load_tokenizer
from engine.loading.default_model import default_model_path
from engine.request import StructuredOutput
from engine.sampling.structured import COMPACT_JSON, GrammarBackend, apply_token_bitmask_, mask_logits_batch
from engine.text.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[A-Z0-9 ]{3,10}$"}},
            "required": ["city"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role"],
}
PERSON_DOC = {
    "name": "Ada Lovelace", "age": 36, "role": "admin", "email": "ada.lovelace@example.org",
    "tags": ["mathematics", "poetry", "analytical engine", "notes", "Bernoulli numbers"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}, "active": False,
}
ORDERS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0},
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        },
        "required": ["sku", "quantity", "status"],
        "additionalProperties": False,
    },
    "minItems": 1,
}
ORDERS_DOC = [
    {"sku": "ABC-1234", "quantity": 2, "price": 19.99, "status": "shipped"},
    {"sku": "XYZ-0042", "quantity": 1, "price": 249.5, "status": "pending"},
    {"sku": "QRS-7781", "quantity": 12, "price": 3.25, "status": "delivered"},
    {"sku": "LMN-0007", "quantity": 5, "status": "cancelled"},
]
FREE_DOC = {
    "title": "Quarterly report", "year": 2026, "draft": True, "authors": ["Kim", "Okafor", "Lindqvist"],
    "sections": [{"heading": "Revenue", "pages": 4, "figures": [1.5, 2.25]},
                 {"heading": "Outlook", "pages": 2, "notes": None}],
    "meta": {"lang": "en", "reviewed": False},
}
CASES = [("person", PERSON, PERSON_DOC), ("orders", ORDERS, ORDERS_DOC), ("json_object", None, FREE_DOC)]
LIBRARIES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}


class LLGuidance:
    """engine/sampling/structured.py's own path: GrammarBackend + GrammarMatcher."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.backend = GrammarBackend(tokenizer, vocab_size, tokenizer.eos_token_ids)
        self._num_compiles = 0

    def compile(self, schema: dict | None):
        """A first use of a spec: trailing spaces make each one new to the backend's cache."""
        self._num_compiles += 1
        text = json.dumps(schema or {"type": "object"}) + " " * self._num_compiles
        return self.backend.matcher(StructuredOutput("json_schema", text))

    def matcher(self, schema: dict | None):
        return self.backend.matcher(_spec(schema))

    def fill(self, matcher, bitmask: np.ndarray) -> None:
        matcher.fill_bitmask(bitmask[0])

    def accept(self, matcher, token_id: int) -> None:
        matcher.accept(token_id)


class _CompiledOnce:
    """Compiles each schema once, then starts a matcher on the compiled form."""

    def matcher(self, schema: dict | None):
        key = json.dumps(schema)
        if key not in self._compiled:
            self._compiled[key] = self.compile(schema)
        return self.start(self._compiled[key])


class XGrammar(_CompiledOnce):
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import xgrammar as xgr

        special = tokenizer.special_token_ids
        vocab = [b"" if i in special else t for i, t in enumerate(tokenizer.token_bytes())]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: dict[str, object] = {}

    def compile(self, schema: dict | None):
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(",", ":"), strict_mode=False)

    def start(self, compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(torch.from_numpy(bitmask))

    def accept(self, matcher, token_id: int) -> None:
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"xgrammar rejected token {token_id}")


class OutlinesCore(_CompiledOnce):
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import outlines_core

        eos = self.eos_token_id = min(tokenizer.eos_token_ids)
        skip = tokenizer.special_token_ids | tokenizer.eos_token_ids
        by_bytes: dict[bytes, list[int]] = {}
        for i, t in enumerate(tokenizer.token_bytes()):
            if t and i not in skip:
                by_bytes.setdefault(t, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, by_bytes)
        self._compiled: dict[str, object] = {}

    def compile(self, schema: dict | None):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema or {"type": "object"}), "")
        return outlines_core.Index(regex, self.vocabulary)

    def start(self, compiled):
        import outlines_core

        return outlines_core.Guide(compiled)

    def fill(self, matcher, bitmask: np.ndarray) -> None:
        matcher.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)

    def accept(self, matcher, token_id: int) -> None:
        if token_id == self.eos_token_id:  # its Guide has no transition on EOS: EOS is allowed when finished
            if not matcher.is_finished():
                raise RuntimeError("EOS before the document is complete")
            return
        matcher.advance(token_id)


ADAPTERS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def _spec(schema: dict | None) -> StructuredOutput:
    return StructuredOutput("json_object") if schema is None else StructuredOutput("json_schema", json.dumps(schema))


def replay(adapter, schema: dict | None, token_ids: list[int], vocab_size: int, reps: int) -> dict[str, float]:
    """Per-token times over ``reps`` replays of ``token_ids`` (then EOS), each with a fresh matcher."""
    bitmask = np.empty((1, (vocab_size + 31) // 32), dtype=np.int32)
    logits = torch.randn(1, vocab_size)
    times: dict[str, list[float]] = {"total": [], "mask": [], "apply": [], "accept": [], "wall": []}
    for _ in range(reps):
        matcher = adapter.matcher(schema)
        for token_id in token_ids:
            w0, t0 = time.perf_counter(), time.thread_time()
            adapter.fill(matcher, bitmask)
            t1 = time.thread_time()
            apply_token_bitmask_(logits, bitmask, [0])
            t2 = time.thread_time()
            adapter.accept(matcher, token_id)
            t3, w3 = time.thread_time(), time.perf_counter()
            if not np.unpackbits(bitmask.view(np.uint8), bitorder="little")[token_id]:
                raise RuntimeError(f"the mask forbids token {token_id} of the valid document")
            for series, dt in zip(times.values(), (t3 - t0, t1 - t0, t2 - t1, t3 - t2, w3 - w0)):
                series.append(dt * 1e6)
    return {"p90": float(np.percentile(times["total"], 90))} | {k: statistics.median(v) for k, v in times.items()}


def batch_line(adapter: LLGuidance, token_ids: list[int], vocab_size: int, batch: int = 8, reps: int = 20) -> str:
    """llguidance only: ``batch`` matchers at staggered points of one document, masked row by row
    (``mask_logits``) vs at once (``mask_logits_batch``: masks on llguidance's thread pool, one apply)."""
    spec = _spec(PERSON)
    matchers = [adapter.backend.matcher(spec, token_ids[: i * len(token_ids) // (batch + 1)]) for i in range(batch)]
    logits = torch.randn(batch, vocab_size)
    rows = list(range(batch))
    per_row, batched = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for row, matcher in zip(rows, matchers):
            matcher.mask_logits(logits[row])
        t1 = time.perf_counter()
        mask_logits_batch(matchers, logits, rows)
        t2 = time.perf_counter()
        per_row.append(t1 - t0)
        batched.append(t2 - t1)
    one_by_one_us, batched_us = (statistics.median(t) * 1e6 / batch for t in (per_row, batched))
    return (f"llguidance, {batch} person matchers, wall µs per row: mask_logits one by one {one_by_one_us:.0f}, "
            f"mask_logits_batch {batched_us:.0f}")


def imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20, help="replays of each document (fresh matcher each)")
    ap.add_argument("--compile-reps", type=int, default=3)
    ap.add_argument("--engine", action="store_true", help="also measure end to end in duet's engine")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(default_model_path())
    vocab_size = tokenizer.vocab_size
    missing = [n for n, m in LIBRARIES.items() if importlib.util.find_spec(m) is None]
    print(f"tokenizer: SmolLM2-135M-Instruct GGUF, {vocab_size} ids; whitespace: compact {COMPACT_JSON}")
    print(f"missing (not benchmarked): {', '.join(missing) or 'none'}")
    docs = {name: tokenizer.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)
            for name, _, doc in CASES}
    print("documents: " + ", ".join(f"{name} {len(ids)} tokens" for name, ids in docs.items()))
    print("\n| library | version | imports torch | tokenizer index ms |")
    print("|---|---|---|---|")
    adapters = {}
    for name in (n for n in LIBRARIES if n not in missing):
        t0 = time.perf_counter()
        adapters[name] = ADAPTERS[name](tokenizer, vocab_size)
        setup_ms = (time.perf_counter() - t0) * 1e3
        print(f"| {name} | {importlib.metadata.version(name)} | {imports_torch(LIBRARIES[name])} | {setup_ms:.0f} |")
    print("\n| library | schema | compile ms | µs/token median | p90 | mask | apply | accept | wall median |")
    print("|---|---|---|---|---|---|---|---|---|")
    eos = min(tokenizer.eos_token_ids)
    for name, adapter in adapters.items():
        for case, schema, _ in CASES:
            compile_s = []
            for _ in range(args.compile_reps):
                t0 = time.perf_counter()
                adapter.compile(schema)
                compile_s.append(time.perf_counter() - t0)
            try:
                r = replay(adapter, schema, docs[case] + [eos], vocab_size, args.reps)
            except Exception as e:  # a library that cannot replay the document: say so, go on
                print(f"| {name} | {case} | {min(compile_s) * 1e3:.1f} | failed: {e} | | | | | |")
                continue
            print(f"| {name} | {case} | {min(compile_s) * 1e3:.1f} | {r['total']:.0f} | {r['p90']:.0f} "
                  f"| {r['mask']:.0f} | {r['apply']:.0f} | {r['accept']:.0f} | {r['wall']:.0f} |")
    if "llguidance" in adapters:
        print("\n" + batch_line(adapters["llguidance"], docs["person"], vocab_size))
    if args.engine:
        engine_overhead()


def engine_overhead(num_requests: int = 8, reps: int = 3) -> None:
    """Per generated token, json_schema vs unconstrained, same lengths, in duet's engine (SmolLM2 fp32)."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    torch.set_num_threads(2)
    engine = Engine(EngineConfig(model=str(default_model_path()), dtype="float32"))
    schema = CASES[0][1]
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": f"Describe person number {i} as JSON."}],
                                            add_generation_prompt=True) for i in range(num_requests)]
    constrained = [SamplingParams(max_tokens=200, temperature=0.7, seed=i, structured=_spec(schema))
                   for i in range(num_requests)]
    engine.generate(prompts, constrained)  # warm-up: compiles the grammar, builds the token table
    lengths = [len(r["token_ids"]) for r in engine.generate(prompts, constrained)]
    plain = [SamplingParams(max_tokens=n, temperature=0.7, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
    times: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    for _ in range(reps):  # interleaved, so drift hits both alike
        for label, params in (("json_schema", constrained), ("unconstrained", plain)):
            engine.pool.reset_prefix_cache()  # both runs prefill their prompts
            t0 = time.perf_counter()
            out = engine.generate(prompts, params)
            times[label].append((time.perf_counter() - t0) / sum(len(r["token_ids"]) for r in out))
    js, un = min(times["json_schema"]), min(times["unconstrained"])
    print(f"\nengine, SmolLM2 fp32, {num_requests} concurrent chat requests, {sum(lengths)} tokens "
          f"(schema 'person', best of {reps}): json_schema {js * 1e3:.2f} ms/token, unconstrained "
          f"{un * 1e3:.2f} ms/token, overhead {(js - un) * 1e6:.0f} µs/token ({(js / un - 1) * 100:+.1f} %)")


if __name__ == "__main__":
    main()
