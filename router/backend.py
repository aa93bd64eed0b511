"""The seam between the front doors (HTTP, gRPC) and whatever runs the model.

A front door parses and validates a client's call, tokenizes it (the router owns tokenization, so
it can hash blocks and route), and then only needs a token stream per request:

    backend.check_request(prompt_token_ids, params)       # InvalidRequestError -> HTTP 400 / INVALID_ARGUMENT
    async for out in backend.generate(request_id, prompt_token_ids, params):
        ...                                                # engine.outputs.RequestOutput, one per step
Closing the iterator early (client gone, task cancelled) aborts the request everywhere it runs and
frees its KV blocks; implementations guarantee that.

Two implementations: `cluster.local_backend.LocalBackend` (one in-process engine: tests, `duet serve
--colocated`) and `router.dispatch.cluster_backend.ClusterBackend` (prefill/decode pools, routing). This module imports
no torch: the router process never loads the model.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.loading.weights_summary import WeightsSummary
from engine.outputs import RequestOutput
from engine.request import SamplingParams, check_prompt
from engine.text.tokenizer import Tokenizer
from router.lora_adapters import LoraAdapters


@dataclass(frozen=True)
class ModelCard:
    """What `/v1/models` lists and what requests are checked against."""

    model_id: str  # the name clients put in "model"
    max_model_len: int  # prompt + max_tokens must fit
    vocab_size: int
    created: int = 0  # unix seconds
    longrope_original_len: int | None = None  # LongRoPE's pre-training length (the factor-set boundary), or None
    weights: WeightsSummary | None = None  # what the engines hold and run (the ``duet`` object of /v1/models)
    # LoRA adapters served on this model at start (engine/lora/): a request names one in "model" (vLLM's rule);
    # ``Backend.lora_adapters()`` is the set now (adapters load and unload at run time)
    lora_adapters: tuple[str, ...] = ()


@dataclass(frozen=True)
class Health:
    ok: bool
    detail: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    card: ModelCard
    tokenizer: Tokenizer
    # the LoRA adapters served now, loaded and unloaded at run time (router/lora_adapters.py); None: this backend
    # serves the card's adapters and cannot change them
    lora: LoraAdapters | None = None

    def lora_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name in ``model`` now (``/v1/models`` lists them)."""
        return self.lora.names() if self.lora is not None else self.card.lora_adapters

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError for a request that can never run (checked before anything is queued)."""
        check_prompt(prompt_token_ids, params, vocab_size=self.card.vocab_size, max_model_len=self.card.max_model_len)

    @abstractmethod
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one has ``finished=True`` (finish_reason stop / length /
        abort / error, with ``error`` set for error). Raises InvalidRequestError before the first output
        for a request the workers refuse."""

    @abstractmethod
    def health(self) -> Health: ...

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release resources (engine threads, connections)."""
