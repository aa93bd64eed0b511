"""bench-llamacpp's report: one markdown table per model (engine rows, memory, serving rows) from the results
JSON, then the ratios; the last line ``ratio: <batch-1 decode duet / llama.cpp, synthetic 1.5B Q4_K_M>`` with
duet's default activations (fp32)."""
from __future__ import annotations

from collections.abc import Mapping

DUET_DEFAULT = "duet fp32"  # quantized_activations fp32: the default, token-exact with the dense model
DUET_INT8 = "duet int8"  # quantized_activations int8: llama.cpp's accuracy class (its prefill: bf16 tiles on AMX)
LLAMA = "llama.cpp"
RATIO_MODEL = "synthetic-1.5b-q4_k_m"


def best(samples: list[float] | None) -> float | None:
    return max(samples) if samples else None


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def engine_table(engine: Mapping) -> list[str]:
    sides = list(engine["sides"])
    duets = [s for s in (DUET_DEFAULT, DUET_INT8) if s in sides]
    lines = ["| best of " + str(engine["rounds"]) + " (tok/s) | " + " | ".join(sides) + " | " +
             " | ".join(f"{d} / llama.cpp" for d in duets) + " |", "|---" * (len(sides) + len(duets) + 1) + "|"]
    for test, name in (("decode", "batch-1 decode, 128 tokens"), ("prefill", "prefill, 512 tokens")):
        runs = engine[test]
        cells = [_num(best(runs.get(s))) for s in sides]
        ratios = [_num(_ratio(best(runs.get(d)), best(runs.get(LLAMA))), '{:.2f}x') for d in duets]
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return lines


def serving_table(serving: Mapping) -> list[str]:
    lines = ["| server | streams | requests | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
             "| output tok/s in SLO | failed / wrong count |", "|---" * 8 + "|"]
    for server, levels in serving["runs"].items():
        for c, doc in sorted(levels.items(), key=lambda kv: int(kv[0])):
            s = doc["summary"]
            ttft, tpot = s["ttft_s"], s["tpot_s"]
            lines.append(f"| {server} | {c} | {len(doc['requests'])} | {s['output_throughput']:.1f} | "
                         f"{_num(ttft['p50'], '{:.2f}')} / {_num(ttft['p99'], '{:.2f}')} | "
                         f"{_num(tpot['p50'] and 1e3 * tpot['p50'], '{:.0f}')} / "
                         f"{_num(tpot['p99'] and 1e3 * tpot['p99'], '{:.0f}')} | {doc['slo_output_tok_s']:.1f} | "
                         f"{s['failed']} / {len(doc['count_errors'])} |")
    return lines


def serving_ratio(serving: Mapping, streams: int, key: str) -> tuple[str, float | None, float | None]:
    """(best duet layout, its figure, llama-server's) at ``streams``; ``key``: output_tok_s or slo_output_tok_s."""
    def figure(doc):
        return doc["summary"]["output_throughput"] if key == "output_tok_s" else doc["slo_output_tok_s"]

    runs = serving["runs"]
    llama = runs.get("llama-server", {}).get(str(streams))
    duets = {k: figure(v[str(streams)]) for k, v in runs.items() if k.startswith("duet") and str(streams) in v}
    if not duets or llama is None:
        return "—", None, None
    name = max(duets, key=duets.get)
    return name, duets[name], figure(llama)


def memory_lines(mem: Mapping) -> list[str]:
    r = mem["resident"]
    out = [f"- resident weights: {r['packed_bytes'] / 2**20:.1f} MiB packed ({', '.join(f'{k} x{v}' for k, v in sorted(r['packed_formats'].items()))}) "
           f"+ {r['dense_bytes'] / 2**20:.2f} MiB dense = {r['total_bytes'] / 2**20:.1f} MiB; file's tensors "
           f"{mem['file_tensor_bytes'] / 2**20:.1f} MiB ({mem['file_types']}): **{mem['ratio']:.3f}x** "
           f"(limit 1.15x: {'ok' if mem['ratio'] <= 1.15 else 'OVER'})"]
    if mem.get("dequantized_types"):
        out.append(f"- dequantized at load (not packed): {', '.join(mem['dequantized_types'])}")
    return out


def serving_memory_lines(serving: Mapping) -> list[str]:
    out = []
    for server, m in serving.get("memory", {}).items():
        biggest = max(m["processes"], key=lambda p: p["hwm_bytes"], default=None)
        out.append(f"- {server}: peak RSS {m['hwm_bytes'] / 2**20:,.0f} MiB over {len(m['processes'])} processes "
                   f"(largest {biggest['hwm_bytes'] / 2**20:,.0f} MiB: {biggest['name']}), PSS {m['pss_bytes'] / 2**20:,.0f} MiB"
                   if biggest else f"- {server}: no processes seen")
    for server, fails in serving.get("failed_starts", {}).items():
        out.append(f"- {server}: {len(fails)} start(s) failed and were retried: " +
                   "; ".join(f.splitlines()[-1][:120] for f in fails))
    for server, sizes in serving.get("kv", {}).items():
        for kv in sizes:
            how = f"{kv['size']}: {kv['reason']}" if "reason" in kv else f"context {kv['context_tokens']} tokens"
            out.append(f"- {server}, {kv['engine']}: KV cache {kv['blocks']} blocks of {kv['block_tokens']} tokens "
                       f"({how})")
    return out


def markdown(results: Mapping[str, Mapping]) -> list[str]:
    lines = []
    for res in results.values():
        lines += ["", f"### {res['label']} (`{res['path']}`)", ""]
        if "engine" in res:
            lines += engine_table(res["engine"])
            if res["engine"].get("notes"):
                lines += ["", *[f"- {n}" for n in res["engine"]["notes"]]]
        if "memory" in res:
            lines += ["", *memory_lines(res["memory"])]
        if "serving" in res:
            slo = res["serving"]["slo"]
            lines += ["", f"Serving (SLO: TTFT <= {slo['ttft_s']} s + {1e3 * slo['ttft_per_token_s']:g} ms x prompt "
                          f"tokens, TPOT <= {slo['tpot_s']} s):", "", *serving_table(res["serving"]), "",
                      *serving_memory_lines(res["serving"])]
    return lines


def ratio_lines(results: Mapping[str, Mapping]) -> list[str]:
    lines = []
    for res in results.values():
        parts = []
        if "engine" in res:
            e = res["engine"]
            for test in ("decode", "prefill"):
                r = _ratio(best(e[test].get(DUET_DEFAULT)), best(e[test].get(LLAMA)))
                r8 = _ratio(best(e[test].get(DUET_INT8)), best(e[test].get(LLAMA)))
                parts.append(f"{test} {_num(r, '{:.2f}x')}" + (f" (int8 {r8:.2f}x)" if r8 is not None else ""))
        if "serving" in res:
            for k in ("output_tok_s", "slo_output_tok_s"):
                name, duet, llama = serving_ratio(res["serving"], 32, k)
                r = _ratio(duet, llama)
                parts.append(f"serving 32 streams {'in SLO ' if k.startswith('slo') else ''}"
                             f"{_num(r, '{:.2f}x') if r is not None or duet is None else 'llama.cpp 0'} "
                             f"({name} {_num(duet)} vs {_num(llama)} tok/s)")
        lines.append(f"{res['label']}: duet / llama.cpp: " + ", ".join(parts))
    final = results.get(RATIO_MODEL, {}).get("engine")
    r = _ratio(best(final["decode"].get(DUET_DEFAULT)), best(final["decode"].get(LLAMA))) if final else None
    lines.append(f"ratio: {r:.2f}" if r is not None else f"ratio: n/a (no batch-1 decode of {RATIO_MODEL} in this run)")
    return lines
