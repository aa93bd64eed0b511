"""The simulated cluster's KV handoff (a mixin of bench/sim/cluster.py's ``ClusterSim``, split by responsibility):
the decode engine thread reserves blocks for a handed-off prompt (or waits for them), its transfer thread pulls
what it lacks, the prefill worker's lease is released — or expires first, and the decode worker recomputes. A
handoff aimed at a decode worker that began draining meanwhile goes to a ready one, as
router/dispatch/cluster_backend.py does; a draining prefill worker's handoffs are admitted first, and nothing overtakes
one that waits for room (as decode_worker/worker.py: its drain, a scale-down or a flip, ends when they are read)."""
from __future__ import annotations

from bench.sim.records import Flight, SimWorker
from router.routing.policy import Role, route


class HandoffMixin:
    def _redirect(self, f: Flight) -> None:
        """As ClusterBackend._redirect: a handoff whose decode worker began draining goes to a ready one."""
        decode = self.ready(Role.DECODE)
        if self.workers[f.decode_worker].state == "ready" or not decode:
            return
        d = route(self.policies[Role.DECODE], self.index, self.tracker, Role.DECODE, decode, f.hashes, len(f.prompt))
        self.tracker.finish(f.rid, f.decode_worker)
        f.decode_worker = d.worker
        self.tracker.dispatch(f.rid, d.worker, num_prefill_tokens=0,
                              num_kv_blocks=-(-(len(f.prompt) + f.output_len) // self.hw.block_size))
        self.counters["decode_redirected"] = self.counters.get("decode_redirected", 0) + 1

    def drains(self, f: Flight) -> bool:
        """The handoff's prefill worker is draining: decode admits its handoffs first (decode_worker/worker.py)."""
        return self.workers[f.prefill_worker].state == "draining"

    def _admit(self, now: float, wd: SimWorker, f: Flight) -> None:
        """Decode engine thread: reserve blocks for the handoff (or wait for them), then start the pull — behind
        a draining prefill worker's handoff that waits for room, whatever room there is."""
        if wd.waiting_handoffs and not self.drains(f) and any(self.drains(g) for g in wd.waiting_handoffs):
            wd.waiting_handoffs.append(f)
            return
        try:
            plan = wd.engine.reserve_remote(f.rid, f.prompt, f.output_len, f.hashes)
        except ValueError as e:
            self._release(now, self.workers[f.prefill_worker], f)
            self._fail(now, f, str(e))
            return
        if plan is None:
            self.counters["handoff_waits"] += 1
            wd.waiting_handoffs.append(f)
            return
        self.counters["decode_hit_blocks"] += plan.num_hit_blocks
        wp = self.workers[f.prefill_worker]
        if f.lease_expired:  # the prefill worker let the blocks go: the pull fails, D recomputes
            f.recomputed = True
            wd.engine.fail_remote(f.rid, now)
            return
        if not plan.num_missing_blocks:  # a full prefix hit: nothing to pull, just release the lease
            wd.engine.commit_remote(f.rid, now)
            self._release(now, wp, f)
            return
        self.counters["transferred_blocks"] += plan.num_missing_blocks
        start = max(now, wd.xfer_free_s)
        wd.xfer_free_s = end = start + self.hw.transfer.time_s(plan.num_missing_blocks)
        self.at(end, self._pulled, wd, wp, f)

    def _pulled(self, now: float, wd: SimWorker, wp: SimWorker, f: Flight) -> None:
        wd.inbox.append(lambda t: wd.engine.commit_remote(f.rid, t))
        if not wd.busy:
            self._iterate(now, wd)
        self._release(now, wp, f)

    def _release(self, now: float, wp: SimWorker, f: Flight) -> None:
        """The NIXL notification reached the prefill worker: its tick releases the lease."""
        def release(t: float) -> None:
            wp.engine.release_held(f.rid)

        wp.inbox.append(release)
        if not wp.busy:
            self._iterate(now, wp)

    def _expire_lease(self, now: float, wp: SimWorker, f: Flight) -> None:
        if f.rid in wp.engine.held and f.rid not in self.workers[f.decode_worker].engine.remote_pending:
            f.lease_expired = True
            self.counters["lease_expired"] += 1
            wp.engine.release_held(f.rid)
            self._publish(wp)
            if not wp.busy:
                self._iterate(now, wp)
