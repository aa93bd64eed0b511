"""What the requests the router places ask of the decode pool: cumulative counters the autoscaler's observer reads
as differences per interval (cluster/observe.py; the forecast that uses them: cluster/autoscale_forecast.py).

    demand = DecodeDemand(block_size=16)
    demand.placed(prompt_tokens=900, max_tokens=256)      # a request arrives (once, however often it is placed)
    demand.finished(generated=120, max_tokens=256)        # it ended with a finish reason (stop or length)

``max_tokens`` is what a request may generate, not what it will: the finished requests' generated / asked tokens
scale the asks (the forecast's ``output_ratio``). A request that failed or was aborted says nothing of how long
outputs run and is not counted as finished.

Decode's share is every token but the first: the prefill's step writes the first token (on a prefill worker, or on a
decode worker prefilling a short prompt itself), so a request of ``max_tokens`` 1 never reaches a decode step and
asks decode for nothing (it is not counted as a decode arrival); one of ``max_tokens`` n asks n - 1 decode steps,
holding prompt + 1 + (n - 1) / 2 tokens of KV at mid-output. A 1-token prefill burst read as decode demand sized
decode for 11,000 workers (tests/cluster/test_operating.py's autoscaler soak).
"""
from __future__ import annotations

from dataclasses import dataclass


def kv_block_tokens(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """What one request asks of decode's KV over its life: the blocks it holds at mid-output × its output
    tokens (block-tokens; × seconds per token = block-seconds)."""
    return -(-(2 * prompt_tokens + max_tokens) // (2 * block_size)) * max_tokens


@dataclass
class DecodeDemand:
    block_size: int
    requests: int = 0
    output_tokens: int = 0  # decode tokens the placed requests may ask (max_tokens - 1 each)
    kv_block_tokens: int = 0  # kv_block_tokens() of the placed requests' decode steps
    finished_tokens: int = 0  # decode tokens the finished requests generated ...
    finished_requested: int = 0  # ... of those they asked

    def placed(self, prompt_tokens: int, max_tokens: int) -> None:
        if max_tokens <= 1:  # its one token is the prefill's
            return
        self.requests += 1
        self.output_tokens += max_tokens - 1
        self.kv_block_tokens += kv_block_tokens(prompt_tokens + 1, max_tokens - 1, self.block_size)

    def finished(self, generated: int, max_tokens: int) -> None:
        if max_tokens <= 1:
            return
        self.finished_tokens += max(0, generated - 1)
        self.finished_requested += max_tokens - 1

    def counters(self) -> dict[str, int]:
        """The Observation fields these counters feed (cumulative: the observer takes differences)."""
        return {"decode_requests_arrived": self.requests, "output_tokens_requested": self.output_tokens,
                "kv_block_tokens_requested": self.kv_block_tokens, "output_tokens_finished": self.finished_tokens,
                "output_tokens_finished_requested": self.finished_requested}
