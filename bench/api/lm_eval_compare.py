"""lm-evaluation-harness through `duet serve`: the same scores as lm-eval's own ``hf`` backend, same checkpoint.

    make eval-compare     # python -m bench.api.lm_eval_compare [--limit N] [--batch-size 8] [--only hf|duet]
                          #                                 [--base-url http://127.0.0.1:8000]
                          #                                 [--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2]

Two tasks written for this check live in bench/api/lm_eval_tasks/ with their data (no hub): ``duet_mc``, 40
four-way multiple-choice questions scored by log-likelihood (acc, acc_norm), and ``duet_short_answer``, 20
short questions answered by greedy generation up to a newline (at most 16 tokens) and scored by exact match.
Both run twice on SmolLM2-135M-Instruct as the fp32 Hugging Face directory that bench/hf_model.py writes:

1. lm-eval's ``hf`` backend: transformers on the CPU, float32, batch size 1 — the reference;
2. lm-eval's ``local-completions`` backend against ``duet serve`` on 127.0.0.1 (1 prefill + 1 decode worker,
   every prompt prefilled on the prefill worker: ``--local-prefill-max-tokens 0``), or against ``--base-url``.
   Prompts go as token ids, ``--batch-size`` of them in one /v1/completions request (a list of prompts).
   A log-likelihood request is ``echo: true, logprobs: 1, max_tokens: 1``; lm-eval sums
   ``choices[i].logprobs.token_logprobs[ctxlen:-1]`` (the continuation's tokens: the prompt's first
   ``ctxlen`` entries and the one generated token dropped). A generation request carries ``stop: ["\\n",
   "<|im_end|>"]`` and ``max_tokens: 16``; lm-eval takes ``choices[i].text`` as it is (no stop trimming).

Printed: each metric from both backends side by side, then every document whose per-document outcome
differs (with both backends' log-likelihoods or texts) and the largest log-likelihood gap, and last
``agreement: <equal>/<metrics>``; the exit status is 1 when any metric differs. Each backend's results and
per-document samples go to ``build/eval-compare/{hf,duet}.json``, the server's log beside them.

``--kv-cache-dtype int8`` (issue 49, must-show 3) serves with a quantized KV cache: its scores are not expected to
equal fp32's, so each metric is held against the hf backend's within lm-eval's own standard error of that metric
(``acc_stderr`` ...; where it reports N/A, its ``mean_stderr`` formula over the documents' 0/1 scores,
sqrt(p (1 - p) / (n - 1))), printed as ``within stderr: <n>/<metrics>`` (the exit status 1 when one is not), next to the
number of documents whose outcome changed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.hf_model import DEFAULT_DIR as HF_DIR
from bench.hf_model import ensure_hf_model
from bench.serve.servers import MODEL_NAME, Server, ServerSpec

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = REPO / "bench" / "api" / "lm_eval_tasks"
TASKS = ("duet_mc", "duet_short_answer")
OUT = REPO / "build" / "eval-compare"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# every prompt through the prefill worker and NIXL, as `make run` serves; a small KV cache is plenty here
SERVE_ARGS = ["--local-prefill-max-tokens", "0", "--kv-cache-bytes", str(256 << 20)]


def materialize_tasks(dest: Path) -> Path:
    """The task YAMLs with their ``data_files`` made absolute: lm-eval hands them to ``datasets``, which
    resolves a relative path against the working directory, not against the YAML."""
    import yaml

    dest.mkdir(parents=True, exist_ok=True)
    for src in sorted(TASK_DIR.glob("*.yaml")):
        config = yaml.safe_load(src.read_text())
        files = config["dataset_kwargs"]["data_files"]
        config["dataset_kwargs"]["data_files"] = {split: str(REPO / path) for split, path in files.items()}
        # JSON is YAML, and its "\n" escapes stay readable
        (dest / src.name).write_text(json.dumps(config, indent=1) + "\n")
    return dest


def hf_model_args(model_dir: Path) -> dict:
    return {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu", "batch_size": 1}


def duet_model_args(base_url: str, model_dir: Path, batch_size: int) -> dict:
    # tokenizer_backend named: "auto" would first probe the server for /tokenizer_info and /tokenize
    return {"model": MODEL_NAME, "base_url": f"{base_url}/v1/completions", "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1,
            "max_retries": 1, "batch_size": batch_size}


def evaluate(model: str, model_args: dict, task_dir: Path, limit: int | None) -> dict:
    """One lm-eval run of both tasks: ``{"results": {task: {"acc,none": ...}}, "samples": {task: [...]},
    "wall_s": ...}``. No bootstrap: the comparison is of the scores, not their error bars."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS),
                                  task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                  limit=limit, bootstrap_iters=0, log_samples=True)
    return {"results": out["results"], "samples": out["samples"], "wall_s": time.perf_counter() - t0}


def evaluate_duet(model_dir: Path, task_dir: Path, out: Path, *, limit: int | None, batch_size: int,
                  base_url: str | None = None, kv_cache_dtype: str = "auto") -> dict:
    """lm-eval's ``local-completions`` against ``base_url``, or against a ``duet serve`` started here (its
    own Ray, stopped with it; its log in ``out``)."""
    if base_url:
        return evaluate("local-completions", duet_model_args(base_url, model_dir, batch_size), task_dir, limit)
    extra = SERVE_ARGS + (["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype != "auto" else [])
    server = Server(ServerSpec("duet-disagg-1p1d", "duet-disagg", prefill=1, decode=1, extra=extra), model_dir, out)
    try:
        ready_s = server.wait_ready()
        say(f"duet serve ready in {ready_s:.0f} s at {server.base_url}")
        run = evaluate("local-completions", duet_model_args(server.base_url, model_dir, batch_size), task_dir, limit)
        run["server_ready_s"] = ready_s
        return run
    finally:
        server.stop(stop_ray=False)


def metric_values(results: dict) -> dict[tuple[str, str], float]:
    """``{(task, "acc,none"): value}``: every score of every task, no stderr."""
    return {(task, key): value for task in TASKS for key, value in results.get(task, {}).items()
            if "," in key and "_stderr" not in key and isinstance(value, (int, float))}


@dataclass
class Comparison:
    rows: list[tuple[str, str, float | None, float | None]]  # task, metric, hf, duet
    doc_diffs: list[str] = field(default_factory=list)
    num_docs: int = 0
    max_loglik_gap: float | None = None

    @property
    def num_equal(self) -> int:
        return sum(a is not None and a == b for _, _, a, b in self.rows)

    @property
    def all_equal(self) -> bool:
        return bool(self.rows) and self.num_equal == len(self.rows)


def compare(hf: dict, duet: dict) -> Comparison:
    a, b = metric_values(hf["results"]), metric_values(duet["results"])
    rows = [(task, metric, a.get((task, metric)), b.get((task, metric))) for task, metric in sorted(a.keys() | b.keys())]
    cmp = Comparison(rows)
    for task in TASKS:
        theirs = {s["doc_id"]: s for s in duet["samples"].get(task, [])}
        for ref in hf["samples"].get(task, []):
            cmp.num_docs += 1
            got = theirs.get(ref["doc_id"])
            if got is None:
                cmp.doc_diffs.append(f"{task} doc {ref['doc_id']}: no duet sample")
                continue
            gap = _loglik_gap(ref, got)
            if gap is not None:
                cmp.max_loglik_gap = gap if cmp.max_loglik_gap is None else max(cmp.max_loglik_gap, gap)
            if _outcome(ref) != _outcome(got):
                cmp.doc_diffs.append(f"{task} doc {ref['doc_id']} ({ref['doc'].get('question', '')!r}):\n"
                                     f"    hf   {_describe(ref)}\n    duet {_describe(got)}")
    return cmp


def within_stderr(hf: dict, duet: dict) -> list[tuple[str, str, float, float, float, bool]]:
    """Per metric (task, metric, hf, duet, hf's stderr, |hf - duet| <= stderr)."""
    a, b = metric_values(hf["results"]), metric_values(duet["results"])
    rows = []
    for (task, metric), ref in sorted(a.items()):
        name, _, filt = metric.partition(",")
        err = hf["results"][task].get(f"{name}_stderr,{filt}")
        if not isinstance(err, (int, float)):  # "N/A" when lm-eval skips it: its mean_stderr, sample stdev / sqrt(n)
            n = len(hf["samples"].get(task, []))
            err = math.sqrt(ref * (1 - ref) / (n - 1)) if n > 1 and 0 <= ref <= 1 else None
        got = b.get((task, metric))
        ok = got is not None and isinstance(err, (int, float)) and abs(got - ref) <= err
        rows.append((task, metric, ref, got, err, ok))
    return rows


def _logliks(sample: dict) -> list[float] | None:
    """A multiple-choice sample's per-choice log-likelihoods; None for a generation."""
    resps = sample["filtered_resps"]
    if resps and isinstance(resps[0], (list, tuple)):
        return [float(r[0]) for r in resps]
    return None


def _outcome(sample: dict) -> tuple:
    """What decides the document's scores: its per-document metrics and the chosen answer or the text."""
    lls = _logliks(sample)
    pick = max(range(len(lls)), key=lls.__getitem__) if lls else tuple(sample["filtered_resps"])
    return tuple(sample[m] for m in sample["metrics"]), pick


def _describe(sample: dict) -> str:
    metrics = ", ".join(f"{m}={sample[m]}" for m in sample["metrics"])
    lls = _logliks(sample)
    shown = "loglik [" + ", ".join(f"{x:.6f}" for x in lls) + "]" if lls else f"text {sample['resps'][0][0]!r}"
    return f"{metrics}; {shown}"


def _loglik_gap(a: dict, b: dict) -> float | None:
    la, lb = _logliks(a), _logliks(b)
    if la is None or lb is None or len(la) != len(lb):
        return None
    return max(abs(x - y) for x, y in zip(la, lb))


def format_scores(name: str, run: dict) -> str:
    lines = [f"{name}: {run['wall_s']:.1f} s"]
    lines += [f"  {task:<18} {metric:<20} {value:.4f}" for (task, metric), value in metric_values(run["results"]).items()]
    return "\n".join(lines)


def format_comparison(cmp: Comparison) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    lines = [f"{'task':<18} {'metric':<20} {'hf':>8} {'duet':>8}"]
    lines += [f"{task:<18} {metric:<20} {fmt(a):>8} {fmt(b):>8}{'' if a == b else '   DIFFERS'}"
              for task, metric, a, b in cmp.rows]
    lines.append(f"documents: {cmp.num_docs - len(cmp.doc_diffs)}/{cmp.num_docs} with the same outcome; largest "
                 f"log-likelihood gap {'-' if cmp.max_loglik_gap is None else f'{cmp.max_loglik_gap:.2e}'}")
    lines += cmp.doc_diffs
    lines.append(f"agreement: {cmp.num_equal}/{len(cmp.rows)}")
    return "\n".join(lines)


def save(path: Path, run: dict) -> None:
    from lm_eval.utils import handle_non_serializable

    path.write_text(json.dumps(run, indent=1, default=handle_non_serializable))


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_backends(out: Path, *, limit: int | None = None, batch_size: int = 8, only: str | None = None,
                 base_url: str | None = None, kv_cache_dtype: str = "auto") -> dict[str, dict]:
    """``{"hf": run, "duet": run}`` (or the one named by ``only``), each saved as ``out/<name>.json``."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_hf_model(REPO / HF_DIR)
    task_dir = materialize_tasks(out / "tasks")
    runs = {}
    if only != "duet":
        say("lm-eval hf backend")
        runs["hf"] = evaluate("hf", hf_model_args(model_dir), task_dir, limit)
    if only != "hf":
        say(f"lm-eval local-completions against {base_url or 'duet serve'}")
        runs["duet"] = evaluate_duet(model_dir, task_dir, out, limit=limit, batch_size=batch_size, base_url=base_url,
                                     kv_cache_dtype=kv_cache_dtype)
    for name, run in runs.items():
        save(out / (f"{name}-{kv_cache_dtype}.json" if name == "duet" and kv_cache_dtype != "auto" else
                    f"{name}.json"), run)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, help="only the first N documents of each task")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per /v1/completions request (duet)")
    p.add_argument("--only", choices=("hf", "duet"), help="run one backend and print its scores")
    p.add_argument("--base-url", help="an already running server instead of starting duet serve")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8_e4m3", "fp8_e5m2"),
                   help="serve duet with this KV cache dtype; metrics then held within the hf backend's stderr")
    args = p.parse_args(argv)
    runs = run_backends(Path(args.out), limit=args.limit, batch_size=args.batch_size, only=args.only,
                        base_url=args.base_url, kv_cache_dtype=args.kv_cache_dtype)
    for name, run in runs.items():
        print(format_scores(name, run))
    if len(runs) == 1:
        return 0
    cmp = compare(runs["hf"], runs["duet"])
    print(format_comparison(cmp))
    if args.kv_cache_dtype == "auto":
        return 0 if cmp.all_equal else 1
    rows = within_stderr(runs["hf"], runs["duet"])
    for task, metric, ref, got, err, ok in rows:
        print(f"{task} {metric}: hf {ref:.4f} +- {err:.4f}, duet ({args.kv_cache_dtype} KV) {got:.4f}: "
              f"{'within' if ok else 'OUTSIDE'} stderr")
    print(f"within stderr: {sum(r[-1] for r in rows)}/{len(rows)}")
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
