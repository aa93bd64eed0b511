"""What the engine streams per request per step. Torch-free: the router and the front doors use it too."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.handoff import KVHandoff


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    # prompt logprobs (params.prompt_logprobs), once, on the request's first output: one per prompt token,
    # the first None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    handoff: KVHandoff | None = None  # prefill role: set on the output that ends with reason "remote"
    # on the first token's output: where its time went in this engine (the router splits TTFT with it):
    # queue_s = arrival -> first scheduled, compute_s = first scheduled -> first token
    ttft_parts: dict[str, float] | None = None
