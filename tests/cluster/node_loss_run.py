"""The node-loss scenario (issue 24), run in its own process with its own multi-node Ray:

    python -m tests.cluster.node_loss_run --model DIR --out result.json [--rounds 1]

A local Ray cluster of separate raylets on one machine (`ray.cluster_utils.Cluster`): a head that holds no
duet worker, nodes A and B with room for one prefill and one decode worker each (custom resources that the
pools ask for: ``PoolConfig.resources``), so exactly one worker of each role lands on A — checked from Ray's
actor table before anything else happens. A spare node C (the room a KubeRay autoscaler would add) joins
before the load. Two rounds, each under concurrent streaming load — short prompts streaming tokens from the
node's decode worker, long prompts queued and prefilling on its prefill worker:
  1. kill: node A is removed without grace (its raylet, and every process it started in the same moment);
  2. freeze: node C, which took A's replacements (one prefill and one decode worker), stops answering — its
     raylet and workers SIGSTOPped, their connections open (a partition, a hung machine); a spare D joins.
For each round the script records what each request returned, where it was at the fault, and how the
cluster came back; the test (tests/cluster/test_node_loss.py) judges it against a fault-free engine.

Its own process because the test session already has a single-node Ray (tests/cluster/conftest.py
``ray_session``) and a driver talks to one Ray at a time; a process also bounds the cleanup: every raylet
it started is its child, in its process group.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

PREFILL_SLOT, DECODE_SLOT = "nodeloss_prefill", "nodeloss_decode"  # one unit per worker of each role
HANG_BOUND_S = 120
FROZEN: list = []  # processes a "freeze" stopped: killed at the end whatever happens
RECOVERY_BOUND_S = 90


SEED, N_SHORT, N_LONG = 24, 8, 8  # the defaults; the test computes its references from them while the run goes
ROUND_SEEDS = {"kill": 0, "freeze": 10}  # added to the seed


def round_workloads(seed: int, mode: str, n_long: int = N_LONG, n_short: int = N_SHORT):
    """(the load, the batch after the recovery) of one round: (prompts, max_tokens) each."""
    seed += ROUND_SEEDS[mode]
    return workload(seed, n_long=n_long, n_short=n_short), workload(seed + 1, n_long=1, n_short=5)


def workload(seed: int, n_long: int, n_short: int):
    """Long prompts (600-900 tokens: seconds of prefill on a CPU, so they queue) and short ones (stream soon)."""
    rng = random.Random(seed)
    lengths = [rng.randint(20, 200) for _ in range(n_short)] + [rng.randint(600, 900) for _ in range(n_long)]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    max_tokens = [rng.randint(60, 120) for _ in lengths]
    return prompts, max_tokens


def params_for(max_tokens: int):
    from engine.request import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def start_ray_nodes(temp_dir: str):
    """(ray cluster, node A, node B): a head without duet room, then A and B with one slot per role each.

    It leaves the machine's "current Ray" alone: ``cluster_utils`` writes its head's address to the default
    /tmp/ray/ray_current_cluster (and deletes that file at shutdown), which every ``ray.init()`` without an
    address on this machine reads — the test session's own Ray, other checkouts' test runs — and a killed run
    would leave it naming a dead cluster. So both are turned off here, and Ray's files go to ``temp_dir``."""
    import ray
    import ray._common.utils
    import ray._private.utils
    from ray.cluster_utils import Cluster as RayCluster

    ray._private.utils.write_ray_address = lambda *args, **kwargs: None
    ray._common.utils.reset_ray_address = lambda *args, **kwargs: None

    ray_cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                                   "temp_dir": temp_dir})
    room = {"num_cpus": 2, "resources": {PREFILL_SLOT: 1, DECODE_SLOT: 1}, "temp_dir": temp_dir}
    node_a, node_b = ray_cluster.add_node(**room), ray_cluster.add_node(**room)
    ray_cluster.wait_for_nodes()
    ray.init(address=ray_cluster.address, namespace="duet-node-loss", log_to_driver=False)
    return ray_cluster, node_a, node_b


def start_ray_nodes_retrying(temp_dir: str):
    """``start_ray_nodes``, once more if a node did not register in time. Ray gives a raylet a fixed 30 s to
    register with the GCS ("The current node timed out during startup"); with `make test`'s two processes on 2
    vCPUs that was missed once. Only the start is tried again, never the scenario: what was started goes first
    (every process this one started), and the second try writes its logs to ``temp_dir``-1."""
    import psutil

    try:
        return start_ray_nodes(temp_dir)
    except Exception as e:
        if "timed out during startup" not in str(e):
            raise
        print(f"node-loss: Ray's start timed out ({e}); starting it once more", file=sys.stderr, flush=True)
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        return start_ray_nodes(f"{temp_dir}-1")


def actor_nodes(cluster) -> dict[str, str]:
    """worker id -> the Ray node id its actor lives on, as the GCS's actor table has it."""
    import ray

    out = {}
    for worker_id, handle in cluster.pools.handles.items():
        info = ray._private.state.actors(handle._actor_id.hex())
        out[worker_id] = info["Address"]["NodeID"]
    return out


class Load:
    """The requests under way: what each returned, and how far each was when the node died."""

    def __init__(self, backend, prompts, max_tokens, tag: str) -> None:
        self.backend, self.prompts, self.max_tokens, self.tag = backend, prompts, max_tokens, tag
        self.tokens = [[] for _ in prompts]
        self.text = ["" for _ in prompts]
        self.ends: list[dict] = [{} for _ in prompts]

    async def one(self, i: int) -> None:
        try:
            async for out in self.backend.generate(self.rid(i), self.prompts[i], params_for(self.max_tokens[i])):
                if out.finish_reason == "error":
                    self.ends[i] = {"finish_reason": "error", "error": out.error,
                                    "tokens_before_error": len(self.tokens[i])}
                    return
                self.tokens[i] += out.new_token_ids
                self.text[i] += out.new_text
                if out.finished:
                    self.ends[i] = {"finish_reason": out.finish_reason}
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge (e.g. NoWorkersError: a 503)
            self.ends[i] = {"finish_reason": "exception", "error": f"{type(e).__name__}: {e}",
                            "tokens_before_error": len(self.tokens[i])}

    def rid(self, i: int) -> str:
        return f"{self.tag}{i}"

    def results(self) -> list[dict]:
        return [{"token_ids": t, "text": x, **e} for t, x, e in zip(self.tokens, self.text, self.ends)]


def phases_at(load: Load, tracker, victims: dict[str, str]) -> list[dict]:
    """For each request at the moment of the fault: tokens the client had, and which victim workers held it."""
    held = {w: set(tracker.requests_on(w)) for w in victims}
    out = []
    for i in range(len(load.prompts)):
        on = sorted(w for w, rids in held.items() if load.rid(i) in rids)
        out.append({"tokens_sent": len(load.tokens[i]), "on_victim": on, "done": bool(load.ends[i])})
    return out


def lose_node(ray_cluster, node) -> int:
    """The node is lost as a machine is: its raylet killed without grace (``remove_node``) and, in the same
    moment, every process that raylet started (the duet workers among them; the round stops them all first, so
    nothing runs on while this kills). With the raylet alone, its workers notice only 1-3 s later and go on
    prefilling and streaming meanwhile — a slow death, not a lost node."""
    import psutil
    from ray._private import ray_constants

    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    children = raylet.children(recursive=True)
    ray_cluster.remove_node(node, allow_graceful=False)
    killed = 0
    for proc in children:
        with contextlib.suppress(psutil.NoSuchProcess):  # it went down with its raylet already
            proc.send_signal(signal.SIGKILL)
            killed += 1
    return killed


def freeze_node(node) -> list:
    """The node stops answering (a partition, a hung machine): its raylet and every process it started are
    stopped; their connections stay open and nothing on them answers."""
    import psutil
    from ray._private import ray_constants

    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    procs = [raylet, *raylet.children(recursive=True)]
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    FROZEN.extend(procs)
    return procs


async def until(predicate, timeout_s: float, interval_s: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval_s)
    return bool(predicate())


async def recovered(cluster, targets: dict) -> bool:
    from router.routing.policy import Role
    from router.workers.registry import WorkerState

    registry = cluster.registry
    if any(len(registry.ready(role)) != targets[role] for role in (Role.PREFILL, Role.DECODE)):
        return False
    if registry.records(states=(WorkerState.STARTING, WorkerState.DRAINING)):
        return False
    try:
        snapshot = await asyncio.wait_for(cluster.stats(), 10)
    except Exception:  # noqa: BLE001 - a worker still going away: not recovered yet
        return False
    num_prefill = targets[Role.PREFILL]
    return all(s["kv_blocks_used"] == 0 and s["num_requests"] == 0 and s.get("leases_held", 0) == 0
               and (s["role"] != "decode" or s["peers"] == num_prefill) for s in snapshot)


SPARE_ROOM = {"num_cpus": 2, "resources": {PREFILL_SLOT: 1, DECODE_SLOT: 1}}


async def scenario(args, ray_cluster, node_a) -> dict:
    """Two rounds on one cluster: node A is killed; then the node that took A's replacements (one prefill and
    one decode worker: the spare room of one of each) stops answering. Before each, a spare node joins."""
    from cluster.config import ClusterConfig
    from cluster.launcher import Cluster

    overrides = {"model": args.model, "engine.num_blocks": 256, "router.grpc_port": None,
                 "prefill.num_workers": 2, "decode.num_workers": 2, "router.local_prefill_max_tokens": 0,
                 "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5, "prefill.torch_threads": 1,
                 "decode.torch_threads": 1, "prefill.resources": {PREFILL_SLOT: 1},
                 "decode.resources": {DECODE_SLOT: 1}, "transfer.lease_timeout_s": 4.0,
                 "transfer.transfer_timeout_s": 3.0}
    t0 = time.monotonic()
    cluster = await Cluster.start(ClusterConfig.load(None, overrides))
    result: dict = {"start_s": round(time.monotonic() - t0, 1), "rounds": []}
    try:
        # add_node sets signal handlers: main thread only (it blocks the loop a few seconds, before any load)
        spare = ray_cluster.add_node(**SPARE_ROOM, temp_dir=args.temp_dir)
        result["rounds"].append(await fault_round(cluster, ray_cluster, node_a, "kill", args))
        if args.rounds > 1 and "error" not in result["rounds"][-1]:
            ray_cluster.add_node(**SPARE_ROOM, temp_dir=args.temp_dir)
            result["rounds"].append(await fault_round(cluster, ray_cluster, spare, "freeze", args))
    finally:
        await cluster.stop()
    return result


async def fault_round(cluster, ray_cluster, node, mode: str, args) -> dict:
    """Load the cluster, lose ``node`` (``mode``: kill or freeze) once one of its workers streams and the other
    prefills, and record every request's end, the recovery and a batch served afterwards."""
    from router.routing.policy import Role

    result: dict = {"mode": mode, "node": node.node_id}
    placement = actor_nodes(cluster)
    result["placement_before"] = placement
    victims = {w: n for w, n in placement.items() if n == node.node_id}
    result["victims"] = sorted(victims)
    victim_p = [w for w in victims if w.startswith("prefill")]
    victim_d = [w for w in victims if w.startswith("decode")]
    if len(victim_p) != 1 or len(victim_d) != 1:
        result["error"] = f"placement: the node holds {sorted(victims)}, not one worker of each role"
        return result
    targets = dict(cluster.pools.targets)
    dead_before = {r.worker_id for r in cluster.registry.records() if r.state.value == "dead"}

    (prompts, max_tokens), (after_prompts, after_max) = round_workloads(args.seed, mode, args.n_long, args.n_short)
    result["prompts"], result["max_tokens"] = prompts, max_tokens
    load = Load(cluster.backend, prompts, max_tokens, tag=f"{mode}-")
    counters_before, pool_counters_before = dict(cluster.backend.counters), dict(cluster.pools.counters)
    inflight, tracker = cluster.backend.inflight, cluster.backend.tracker
    # the short prompts first: a decode worker on the node streams before the long prompts arrive
    tasks = [asyncio.create_task(asyncio.wait_for(load.one(i), HANG_BOUND_S)) for i in range(args.n_short)]

    def streaming_from_node() -> bool:  # tokens past the prefill's first one came from the node's decode worker
        return any(len(load.tokens[i]) >= 3 and load.rid(i) in tracker.requests_on(victim_d[0])
                   for i in range(args.n_short))

    result["streaming_before_fault"] = await until(streaming_from_node, 60)
    tasks += [asyncio.create_task(asyncio.wait_for(load.one(i), HANG_BOUND_S))
              for i in range(args.n_short, len(prompts))]
    result["prefilling_before_fault"] = await until(lambda: inflight[victim_p[0]] > 0, 30)
    fault_at = time.monotonic()
    # the node's processes stop at once (SIGSTOP), so the phases read next are those the fault meets: killing takes
    # a while (remove_node), during which a fast prefill would otherwise finish and leave nothing to place again
    result["processes_stopped"] = len(await asyncio.to_thread(freeze_node, node))
    result["phases_at_fault"] = phases_at(load, tracker, victims)
    if mode == "kill":
        result["processes_killed"] = await asyncio.to_thread(lose_node, ray_cluster, node)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    result["hung"] = [i for i, o in enumerate(outcomes) if isinstance(o, asyncio.TimeoutError)]
    result["requests_done_s"] = round(time.monotonic() - fault_at, 1)
    result["results"] = load.results()
    result["counters"] = {k: v - counters_before.get(k, 0) for k, v in cluster.backend.counters.items()}

    while not await recovered(cluster, targets) and time.monotonic() < fault_at + RECOVERY_BOUND_S:
        await asyncio.sleep(0.25)
    result["recovered"] = await recovered(cluster, targets)
    result["recovery_s"] = round(time.monotonic() - fault_at, 1)
    result["placement_after"] = actor_nodes(cluster)
    result["ready_after"] = {role.value: sorted(r.worker_id for r in cluster.registry.ready(role))
                             for role in (Role.PREFILL, Role.DECODE)}
    result["dead"] = {r.worker_id: {"reason": r.reason, "fault": r.fault, "found_dead_s": round(r.ended_s - fault_at, 1)}
                      for r in cluster.registry.records() if r.state.value == "dead" and r.worker_id not in dead_before}
    result["pool_counters"] = {k: v - pool_counters_before.get(k, 0) for k, v in cluster.pools.counters.items()}
    # the router's own bookkeeping let go of every request (the dead workers' included)
    result["router_inflight"] = {w: n for w, n in cluster.backend.inflight.items() if n}
    result["tracker_inflight"] = tracker.num_inflight()
    result["worker_stats"] = {s["worker_id"]: {k: v for k, v in s.items() if isinstance(v, (int, float, str))}
                              for s in await cluster.stats()}
    # and the cluster serves again
    after = Load(cluster.backend, after_prompts, after_max, tag=f"{mode}-after-")
    await asyncio.wait_for(asyncio.gather(*(after.one(i) for i in range(len(after_prompts)))), HANG_BOUND_S)
    result["after"] = {"prompts": after_prompts, "max_tokens": after_max, "results": after.results()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--n-short", type=int, default=N_SHORT)
    parser.add_argument("--n-long", type=int, default=N_LONG)
    parser.add_argument("--rounds", type=int, choices=(1, 2), default=2, help="1: the kill only")
    parser.add_argument("--temp-dir", default=f"/tmp/duet-nodeloss-{os.getpid()}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import proto.kv_codec  # noqa: F401 - before Ray is imported: a fresh checkout generates its protobuf code here

    # isort: split
    import psutil
    import ray

    t0 = time.monotonic()
    ray_cluster, node_a, _ = start_ray_nodes_retrying(args.temp_dir)  # on a failure, Ray's logs stay in temp_dir
    try:
        result = asyncio.run(scenario(args, ray_cluster, node_a))
    finally:
        for proc in FROZEN:
            with contextlib.suppress(psutil.NoSuchProcess):  # already gone
                proc.send_signal(signal.SIGKILL)
        ray.shutdown()
        ray_cluster.shutdown()
    for temp_dir in (args.temp_dir, f"{args.temp_dir}-1"):  # the second, when the start was tried again
        shutil.rmtree(temp_dir, ignore_errors=True)
    result["total_s"] = round(time.monotonic() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
