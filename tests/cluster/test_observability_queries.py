"""Every series the Grafana dashboard and the alert rules in deploy/observability query exists in duet's
/metrics — checked against a live scrape of a real cluster that has served disaggregated traffic, not
against a list kept by hand."""
from __future__ import annotations

import json
import re

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.request import SamplingParams
from tests.cluster.test_disagg_cluster import prompts_for, run_all
from tests.deploy.manifests import DEPLOY

pytestmark = pytest.mark.slow
SERIES = re.compile(r"\b((?:vllm:|duet_)[A-Za-z0-9_:]*[A-Za-z0-9_])")


def queries() -> dict[str, str]:
    board = json.loads((DEPLOY / "observability" / "grafana-duet.json").read_text())
    out = {f"grafana: {p['title']} #{t['refId']}": t["expr"] for p in board["panels"] for t in p.get("targets", [])}
    for var in board["templating"]["list"]:
        if var.get("type") == "query":
            out[f"grafana variable {var['name']}"] = var["definition"]
    rules = yaml.safe_load((DEPLOY / "observability" / "duet-alerts.rules.yml").read_text())
    out.update({f"alert: {r['alert']}": r["expr"] for g in rules["groups"] for r in g["rules"]})
    return out


def exposed(text: str) -> set[str]:
    """Every name a PromQL query can select from this exposition (sample names, and the declared names of
    families that have no sample yet, e.g. a labelled counter nobody incremented)."""
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "summary": ("_sum", "_count")}
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


def test_every_queried_series_exists_in_a_live_scrape(cluster_factory, loop_thread):
    cluster = cluster_factory(**{"router.local_prefill_max_tokens": 0})
    prompts = prompts_for(21, lengths=(40, 70))
    run_all(loop_thread, cluster.backend, "obs", prompts, [SamplingParams(max_tokens=6, temperature=0)] * 2)
    loop_thread.run(cluster.pools.poll_stats())  # worker counters as /metrics renders them
    names = exposed(cluster.metrics.render().decode())
    qs = queries()
    assert len(qs) >= 30
    missing = {where: sorted(set(SERIES.findall(expr)) - names) for where, expr in qs.items()}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, missing
    used = {name for expr in qs.values() for name in SERIES.findall(expr)}
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:nixl_num_failed_transfers_total", "duet_workers_min",
            "vllm:kv_cache_usage_perc", "duet_autoscaler_decisions_total"} <= used


def test_a_query_of_a_series_duet_does_not_export_is_caught():
    text = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
    names = exposed(text)
    assert set(SERIES.findall("sum(vllm:num_requests_running)")) <= names
    assert not set(SERIES.findall("sum(vllm:gpu_cache_usage_perc)")) <= names  # a vLLM v0 name duet lacks
