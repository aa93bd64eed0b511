"""d. KV tiers and peers on the GPU scenario: what a host tier, peer fetches and a disk tier buy.

    python -m bench.sim tiers [--configs colocated-4,colocated-8] [--arms abcd] [--limit N]
    python -m bench.sim tier-weights [--config colocated-4] [--rate R] [--alphas 4] [--weights "h,d,p;..."]
                                          [--start N]

Arms, on the same workers, routing and request rates: (a) device cache only, (b) + a host tier per worker,
(c) + host + peer fetches, (d) + host + disk + peer fetches, (e) as (c) with the host tier and peer copies in int8
under the bf16 device cache (issue 49's mixed precision across tiers: the same host bytes hold 256 / 132 the blocks,
each moved at its int8 bytes; opt-in with ``--arms abcde``). Sizes per worker (``tier_sizes``): one H100's
773 device blocks, a host tier of 128 GiB (1 TiB of DRAM per 8-GPU node: 2,048 blocks of 64 MiB), a disk tier
of 1 TiB (16,384 blocks). Rates: the GPU scenario's, scaled by workers / 4. Routing: cache_aware at the
default tier weights (router.routing.policy.DEFAULT_TIER_WEIGHTS), peer weight 0 in (a) and (b) (``arm_weights``).

Per run: goodput, the prefix hit rate by source (bench/sim/records.py ``hit_sources``), and the reference
hit rate of one global LRU holding the cluster's total capacity across tiers (device + host + disk blocks of
every worker) over the same prompts (bench/sim/tiers.py ``global_lru_hit_rate``); also the LRU holding
only the lower tiers' blocks, which is what inclusive tiers can hold distinct (every device block is also
on the host). Prints the tables and ``ratio: <goodput(c) / goodput(a)>`` at the peak-goodput rate of (a)'s
sweep; writes build/bench/sim/gpu-tiers.json and gpu-tiers.png.
"""
from __future__ import annotations

import dataclasses
import functools
import sys

from bench.sim.cluster import Deployment
from bench.sim.scenarios import Scenario, trace
from bench.sim.tiers import TierSpec, global_lru_hit_rate

GIB = 2**30
ARM_NAMES = {"a": "device only", "b": "+ host", "c": "+ host + peers", "d": "+ host + disk + peers",
             "e": "+ int8 host + peers"}


def tier_sizes(sc: Scenario, host_bytes: float = 128 * GIB, disk_bytes: float = 1024 * GIB) -> tuple[int, int]:
    """Host and disk blocks per worker for the scenario's block bytes."""
    bpb = sc.hardware.transfer.bytes_per_block
    return int(host_bytes // bpb), int(disk_bytes // bpb)


def int8_scale(sc: Scenario) -> float:
    """An int8 KV block's bytes over the scenario's (1 byte + an fp32 scale per token and KV head: the engine's
    page layout; 132 / 256 under bf16 with head_dim 128)."""
    model = sc.hardware.step_model.model
    return dataclasses.replace(model, kv_cache_dtype="int8").kv_bytes_per_token / model.kv_bytes_per_token


def arm_spec(arm: str, host_blocks: int, disk_blocks: int, int8: float = 1.0) -> TierSpec | None:
    """``int8``: ``int8_scale`` (arm (e): the same host bytes hold 1 / int8 the blocks, each moved at its int8 size)."""
    return {"a": None, "b": TierSpec(host_blocks), "c": TierSpec(host_blocks, peers=True),
            "d": TierSpec(host_blocks, disk_blocks, peers=True),
            "e": TierSpec(int(host_blocks / int8), peers=True, lower_bytes_scale=int8)}[arm]


def arm_weights(arm: str):
    """The routing weights of an arm: the default's, with peers credited only where the workers fetch from
    them ((c), (d)); (a) and (b) cannot fetch from a peer, so a peer's blocks are worth nothing there."""
    from router.routing.policy import DEFAULT_TIER_WEIGHTS, NO_PEER_FETCH

    return DEFAULT_TIER_WEIGHTS if arm in "cde" else NO_PEER_FETCH


def with_tiers(sc: Scenario, spec: TierSpec | None) -> Scenario:
    return dataclasses.replace(sc, hardware=dataclasses.replace(sc.hardware, tiers=spec))


@functools.lru_cache(maxsize=32)
def lru_reference(sc_workload: tuple, block_size: int, capacity_blocks: int) -> float:
    from engine.kv.hashing import BlockHasher

    hasher = BlockHasher(block_size)
    prompts = [(r.prompt, hasher(r.prompt)) for r in trace(dict(sc_workload))]
    return global_lru_hit_rate(prompts, capacity_blocks, block_size)


def num_workers(dep: Deployment) -> int:
    return dep.prefill + dep.decode


def study_tiers(sc: Scenario, out_dir, configs: tuple[str, ...] = ("colocated-4", "colocated-8"), arms: str = "abcd",
                host_bytes: float = 128 * GIB, disk_bytes: float = 1024 * GIB) -> dict:
    from bench.sim.runs import parse_config, row, run_at, save

    host_blocks, disk_blocks = tier_sizes(sc, host_bytes, disk_bytes)
    wl = tuple(sorted(sc.workload.items()))
    B, dev = sc.hardware.block_size, sc.hardware.num_blocks
    rows, runs = [], []
    for name in configs:
        dep = parse_config(name, sc.local_prefill_max_tokens)
        n = num_workers(dep)
        rates = tuple(r * n / 4 for r in sc.rates)
        for arm in arms:
            spec = arm_spec(arm, host_blocks, disk_blocks, int8_scale(sc))
            lower = (spec.host_blocks + spec.disk_blocks) if spec else 0
            lru = lru_reference(wl, B, n * (dev + lower))
            lru_lower = lru_reference(wl, B, n * lower) if spec else lru
            for rate in rates:
                doc = run_at(with_tiers(sc, spec), dataclasses.replace(dep, tier_weights=arm_weights(arm)), rate)
                runs.append(doc)
                print(f"  {name} ({arm}) {rate:g} req/s: goodput {doc['summary']['goodput']:.3f}, hit "
                      f"{doc['sim']['prefix_hit_rate']:.1%} (LRU {lru:.1%}), {doc['sim']['wall_s']:.0f} s",
                      file=sys.stderr, flush=True)
                src = doc["sim"]["hit_sources"]
                rows.append(row(doc, sc, arm=arm, arm_name=ARM_NAMES[arm], workers=n, lru=lru, lru_lower=lru_lower,
                                hit_lru=doc["sim"]["prefix_hit_rate"] / lru, hit_device=src["device"],
                                hit_tiers=src["tiers"], hit_peer=src["peer"],
                                peer_fetches=doc["sim"]["counters"].get("peer_fetches", 0)))
    device_only = {(r["config"], r["rate"]): r["goodput"] for r in rows if r["arm"] == "a"}
    for r in rows:  # goodput against arm (a) at the same rate
        base = device_only.get((r["config"], r["rate"]))
        r["vs_a"] = r["goodput"] / base if base else None
    text = tables(rows)
    summary = headline(rows, sc.rates[-1])
    print(f"\n## d. KV tiers and peers ({sc.name}; host {host_blocks} blocks = {host_bytes / GIB:g} GiB, disk "
          f"{disk_blocks} blocks = {disk_bytes / GIB:g} GiB per worker; device {dev} blocks)\n{text}\n\n{summary}")
    path = save(f"{sc.name}-tiers", {"study": "tiers", "scenario": sc.describe(), "host_blocks": host_blocks,
                                     "disk_blocks": disk_blocks, "rows": rows, "table": text, "headline": summary,
                                     "runs": runs}, out_dir)
    plot_tiers(rows, path.with_suffix(".png"), sc)
    return {"rows": rows, "table": text, "headline": summary}


def tables(rows: list[dict]) -> str:
    from bench.sim.runs import table

    cols = [("config", "config", ""), ("arm_name", "arm", ""), ("rate", "req/s", "g"), ("goodput", "goodput", ".3f"),
            ("vs_a", "x (a)", ".2f"), ("good_fraction", "met SLO", ".0%"), ("ttft_p90", "TTFT p90 s", ".2f"),
            ("tpot_p90", "TPOT p90 s", ".3f"), ("hit_rate", "hit", ".1%"), ("hit_device", "device", ".1%"),
            ("hit_tiers", "host/disk", ".1%"), ("hit_peer", "peer", ".1%"), ("lru", "global LRU", ".1%"),
            ("hit_lru", "hit / LRU", ".2f"), ("lru_lower", "LRU, lower tiers only", ".1%")]
    return table(rows, cols)


def headline(rows: list[dict], rate_per_4: float) -> str:
    """Per config: hit rate / global LRU of arms (c) and (d), goodput / (a) at every rate and peak goodput
    against (a)'s. The ``ratio:`` line: goodput (c) / (a) of the first config at ``rate_per_4`` req/s per 4
    workers (the top of the GPU scenario's rate sweep)."""
    lines, ratio = [], None
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name]
        by = {(r["arm"], r["rate"]): r for r in rs}
        a = [r for r in rs if r["arm"] == "a"]
        if not a:
            continue
        peak = max(a, key=lambda r: r["goodput"])
        top = rate_per_4 * rs[0]["workers"] / 4
        for arm in "cde":
            c = [r for r in rs if r["arm"] == arm]
            if not c:
                continue
            hit = sum(r["hit_lru"] for r in c) / len(c)
            per_rate = ", ".join(f"{r['rate']:g}: {r['vs_a']:.2f}" for r in c if r["vs_a"] is not None)
            lines.append(f"{name} ({arm}): hit / global LRU {hit:.2f} (mean over rates); goodput / (a) by rate "
                         f"{per_rate}; peak goodput {max(r['goodput'] for r in c):.3f} vs (a) {peak['goodput']:.3f}")
        if ratio is None and ("c", top) in by and by[("a", top)]["goodput"]:
            ratio = (name, top, by[("c", top)]["goodput"] / by[("a", top)]["goodput"])
    if ratio is not None:
        lines.append(f"ratio: {ratio[2]:.2f}  (goodput (c) / (a), {ratio[0]} at {ratio[1]:g} req/s)")
    return "\n".join(lines)


def plot_tiers(rows: list[dict], path, sc: Scenario) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    colors = {"a": "#7f7f7f", "b": "#1f77b4", "c": "#2ca02c", "d": "#9467bd", "e": "#d62728"}
    fig, axes = plt.subplots(2, len(configs), figsize=(6.2 * len(configs), 8.4), squeeze=False)
    for k, name in enumerate(configs):
        rs = [r for r in rows if r["config"] == name]
        ax = axes[0][k]
        for arm in dict.fromkeys(r["arm"] for r in rs):
            pts = sorted((r["rate"], r["goodput"]) for r in rs if r["arm"] == arm)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", lw=2, color=colors[arm],
                    label=f"({arm}) {ARM_NAMES[arm]}")
        top = max(r["rate"] for r in rs)
        ax.plot([0, top], [0, top], ":", color="#bbbbbb", label="offered load")
        ax.set_xlabel("request rate, req/s")
        ax.set_ylabel("goodput, req/s")
        ax.set_title(f"{name}: goodput (TTFT <= {sc.slo['ttft_s']:g} s, TPOT <= {sc.slo['tpot_s'] * 1e3:g} ms)")
        ax.legend(fontsize=8)
        ax = axes[1][k]
        arms = list(dict.fromkeys(r["arm"] for r in rs))
        mean = {arm: {key: sum(r[key] for r in rs if r["arm"] == arm) / sum(1 for r in rs if r["arm"] == arm)
                      for key in ("hit_device", "hit_tiers", "hit_peer", "lru")} for arm in arms}
        x = range(len(arms))
        bottom = [0.0] * len(arms)
        for key, label, color in (("hit_device", "device", "#1f77b4"), ("hit_tiers", "own host/disk", "#aec7e8"),
                                  ("hit_peer", "peer", "#2ca02c")):
            vals = [100 * mean[a][key] for a in arms]
            ax.bar(x, vals, bottom=bottom, color=color, label=label, width=0.6)
            bottom = [b + v for b, v in zip(bottom, vals)]
        lower = {a: next(r["lru_lower"] for r in rs if r["arm"] == a) for a in arms}
        for i, a in enumerate(arms):
            ax.hlines(100 * mean[a]["lru"], i - 0.36, i + 0.36, colors="k", lw=2,
                      label="global LRU of the same total capacity" if i == 0 else None)
            if lower[a] < mean[a]["lru"] - 1e-9:
                ax.hlines(100 * lower[a], i - 0.36, i + 0.36, colors="k", lw=1.5, linestyles="--",
                          label="global LRU of the lower tiers' capacity" if a == "b" else None)
        ax.set_ylim(0, 1.45 * max(bottom + [100 * mean[a]["lru"] for a in arms]))  # room for the legend
        ax.set_xticks(list(x), [f"({a}) {ARM_NAMES[a]}" for a in arms], fontsize=8)
        ax.set_ylabel("prompt tokens from cache, % (mean over rates)")
        ax.set_title(f"{name}: prefix hit rate by source")
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"duet, simulated: KV tiers and peer fetches\n{sc.hardware.name}, Mooncake trace, "
                 f"first {sc.workload['limit']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


TIER_WEIGHT_GRID = ((0.75, 0.25, 0.5), (1.0, 1.0, 1.0), (1.0, 0.5, 0.5), (1.0, 1.0, 0.5), (1.0, 0.5, 1.0),
                    (0.75, 0.5, 0.75), (0.5, 0.25, 0.25), (1.0, 1.0, 0.0))  # (host, disk, peer); Dynamo's first


def sweep_tier_weights(sc: Scenario, out_dir, config: str = "colocated-4", rate: float | None = None,
                       alphas: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0),
                       weights: tuple[tuple[float, float, float], ...] = TIER_WEIGHT_GRID,
                       host_bytes: float = 128 * GIB, disk_bytes: float = 1024 * GIB) -> dict:
    """The routing cost's weights on arm (d) (host + disk + peers): ``alpha`` at the default weights, then
    the tier weights (host, disk, peer) of ``router.routing.policy.TierWeights`` (``Deployment.tier_weights``), each
    at the best alpha (pass ``alphas=(DEFAULT_ALPHA,)`` to hold alpha). Reports hit rate, TTFT, goodput."""
    from bench.sim.runs import parse_config, row, run_at, save, table
    from router.routing.policy import DEFAULT_TIER_WEIGHTS, TierWeights

    rate = rate or sc.rates[-1]
    host_blocks, disk_blocks = tier_sizes(sc, host_bytes, disk_bytes)
    scen = with_tiers(sc, arm_spec("d", host_blocks, disk_blocks))
    dep = dataclasses.replace(parse_config(config, sc.local_prefill_max_tokens), tier_weights=DEFAULT_TIER_WEIGHTS)
    rows = []
    if len(alphas) > 1:
        for alpha in alphas:
            doc = run_at(scen, dataclasses.replace(dep, alpha=alpha), rate)
            rows.append(row(doc, sc, alpha=alpha, weights="(default)"))
    best = max(rows, key=lambda r: r["goodput"])["alpha"] if rows else alphas[0]
    for host, disk, peer in weights:
        w = TierWeights(host=host, disk=disk, peer=peer)
        doc = run_at(scen, dataclasses.replace(dep, alpha=best, tier_weights=w), rate)
        rows.append(row(doc, sc, alpha=best, weights=f"host {host:g}, disk {disk:g}, peer {peer:g}",
                        peer_fetches=doc["sim"]["counters"].get("peer_fetches", 0)))
        print(f"  {config} {rate:g} req/s alpha {best:g} {rows[-1]['weights']}: goodput {rows[-1]['goodput']:.3f}, "
              f"TTFT mean {rows[-1]['ttft_mean']:.2f} s, hit {rows[-1]['hit_rate']:.1%}, {doc['sim']['wall_s']:.0f} s",
              file=sys.stderr, flush=True)
    cols = [("alpha", "alpha", "g"), ("weights", "tier weights", ""), ("hit_rate", "hit", ".1%"),
            ("ttft_mean", "TTFT mean s", ".2f"), ("ttft_p90", "TTFT p90 s", ".2f"), ("goodput", "goodput", ".3f"),
            ("peer_fetches", "peer fetches", "d")]
    text = table(rows, cols)
    start = sc.workload.get("start", 0)
    window = f"requests {start}..{start + sc.workload['limit'] - 1}"
    print(f"\n## d2. routing weights, {config} at {rate:g} req/s, arm (d) ({sc.name}, trace {window})\n{text}")
    save(f"{sc.name}-tier-weights-{config}-{rate:g}" + (f"-start{start}" if start else ""),
         {"study": "tier-weights", "config": config, "rate": rate, "window": window, "rows": rows, "table": text},
         out_dir)
    return {"rows": rows, "table": text}
