"""From a step's logits to the requests' outputs: sampling (or, with drafts, verification), appending the
tokens one at a time through the grammar and the stop checks, finishing requests, building ``RequestOutput``s.
A mixin of ``Engine`` (split from engine/engine.py by responsibility): it uses the engine's scheduler, stats,
requests and speculative decoder."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling.sampler import sample
from engine.sched.output import ScheduledRequest
from engine.speculative.rejection import rejection_sample
from engine.text.stopping import apply_stop_conditions

if TYPE_CHECKING:  # the host, for a type checker only
    from engine.engine import Engine


class EmitMixin:
    def _sample_and_emit(self: Engine, logits: torch.Tensor, sampled: list[ScheduledRequest]) -> list[RequestOutput]:
        """``logits``: the runner's rows (k + 1 consecutive ones for a sequence with k drafts)."""
        outputs = []
        if any(s.request.params.max_tokens == 0 for s in sampled):  # prompt only (echo / prompt logprobs)
            outputs += [self._finish_unsampled(s.request) for s in sampled if s.request.params.max_tokens == 0]
            rows, at = [], 0
            for s in sampled:
                if s.request.params.max_tokens != 0:
                    rows.extend(range(at, at + s.num_draft_tokens + 1))
                at += s.num_draft_tokens + 1
            sampled, logits = [s for s in sampled if s.request.params.max_tokens != 0], logits[rows]
            if not sampled:
                return outputs
        requests = [s.request for s in sampled]
        if any(s.num_draft_tokens for s in sampled):
            res = rejection_sample(logits, requests, self.spec.drafts(sampled))
            tokens, logprobs, tops, accepted = res.token_ids, res.logprobs, res.top_logprobs, res.num_accepted
        else:
            res = sample(logits, requests)
            tokens = [[t] for t in res.token_ids]
            logprobs = [None if lp is None else [lp] for lp in res.logprobs]
            tops = [None if lp is None else [top] for lp, top in zip(res.logprobs, res.top_logprobs)]
            accepted = [0] * len(requests)
        for i, s in enumerate(sampled):
            outputs.append(self._emit(s.request, tokens[i], logprobs[i], tops[i], s.num_draft_tokens, accepted[i]))
        return outputs

    def _emit(self: Engine, request: Request, token_ids: list[int], logprobs: list[float] | None,
              tops: list[dict[int, float]] | None, num_drafts: int, num_accepted: int) -> RequestOutput:
        """Append ``token_ids`` (accepted drafts, then the token after them) until one ends the request."""
        n_before = len(request.text) - request.num_stop_held_chars
        status, emitted = None, []
        for j, token in enumerate(token_ids):
            request.append_output_token(token)
            if logprobs is not None:
                request.output_logprobs.append(logprobs[j])
                request.output_top_logprobs.append(tops[j])
            self.stats.num_generated_tokens += 1
            self.scheduler.on_tokens_appended(request)
            emitted.append(token)
            status = self._advance_grammar(request) or apply_stop_conditions(request, self.max_model_len)
            if status is not None:
                break
        if self.spec is not None:
            self.spec.observe(request, num_drafts, num_accepted, token_ids[0])
        if num_drafts:  # the accepted drafts appended before the last token: their KV, computed by this step
            self.scheduler.on_drafts_accepted(request, min(num_accepted, len(emitted) - 1))
        handoff = None
        if status is not None:
            self.scheduler.remove(request, status)
            del self.requests[request.request_id]
            self.stats.num_finished += 1
            if self.spec is not None:
                self.spec.finish(request, status is not RequestStatus.FINISHED_ERROR)
        elif request.remote_decode:
            handoff = self._hand_off(request)
        new_text = request.text[n_before: len(request.text) - request.num_stop_held_chars]
        out = self._output(request, emitted, new_text, len(emitted))
        out.handoff = handoff
        return out

    @staticmethod
    def _advance_grammar(request: Request) -> RequestStatus | None:
        """Feed the sampled token to the request's grammar; a refusal (the mask makes it impossible, short of
        a bug) ends this request with an error rather than failing the whole step."""
        if request.grammar is None:
            return None
        try:
            request.grammar.accept(request.output_token_ids[-1])
        except RuntimeError as e:
            request.error = f"structured output: {e}"
            return RequestStatus.FINISHED_ERROR
        return None

    def _finish_unsampled(self: Engine, request: Request) -> RequestOutput:
        """A max_tokens=0 request whose prompt is computed: it ends here with reason "length"."""
        request.stop_reason = None
        self.scheduler.remove(request, RequestStatus.FINISHED_LENGTH)
        del self.requests[request.request_id]
        self.stats.num_finished += 1
        return self._output(request, [], "", 0)

    def _output(self: Engine, request: Request, new_ids: list[int], new_text: str, n_new: int) -> RequestOutput:
        finished = request.is_finished
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            new_logprobs=request.output_logprobs[-n_new:] if n_new and request.output_logprobs else [],
            new_top_logprobs=request.output_top_logprobs[-n_new:] if n_new and request.output_top_logprobs else [],
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            error=request.error,
            ttft_parts=request.ttft_parts() if n_new and len(request.output_token_ids) == n_new else None,
            **self._prompt_logprobs_once(request),
        )

    @staticmethod
    def _prompt_logprobs_once(request: Request) -> dict:
        """The prompt logprobs, on the first output after they are complete (and never again)."""
        if (request.params.prompt_logprobs is None or request.prompt_logprobs_sent
                or len(request.prompt_logprobs) < request.num_prompt_tokens):
            return {}
        request.prompt_logprobs_sent = True
        return {"prompt_logprobs": request.prompt_logprobs, "prompt_top_logprobs": request.prompt_top_logprobs}
