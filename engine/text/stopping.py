"""Stop conditions, checked after every appended token, in OpenAI's order of precedence:
EOS / stop token ids, then stop strings (text is cut before the stop string), then length.

Streaming never shows a client part of a stop string: text that could still grow into one is held
back (``num_stop_held_chars``) until it either completes the stop string (and is dropped) or cannot.
"""
from __future__ import annotations

from engine.request import Request, RequestStatus


def apply_stop_conditions(request: Request, max_model_len: int) -> RequestStatus | None:
    token = request.output_token_ids[-1]
    params = request.params
    num_out = len(request.output_token_ids)
    ends = num_out >= params.min_tokens and token in request.eos_token_ids
    if request.detokenizer is not None and not ends:  # an EOS that ends the request is not text (special or not)
        request.text += request.detokenizer.add(token)
    if num_out >= params.min_tokens:
        if ends:
            return _finish(request, RequestStatus.FINISHED_STOPPED, None)
        if token in params.stop_token_ids:
            return _finish(request, RequestStatus.FINISHED_STOPPED, token)
        if params.stop and request.detokenizer is not None:
            hit = _find_stop(request, params.stop)
            if hit is not None:
                return _finish(request, RequestStatus.FINISHED_STOPPED, hit)
    if num_out >= params.max_tokens or request.num_tokens >= max_model_len:
        return _finish(request, RequestStatus.FINISHED_LENGTH, None)
    # (also without stop strings: a resumed request starts with its unsent tail held, released here)
    request.num_stop_held_chars = held_chars(request.text, params.stop)
    return None


def _finish(request: Request, status: RequestStatus, stop_reason) -> RequestStatus:
    if request.detokenizer is not None and not isinstance(stop_reason, str):
        request.text += request.detokenizer.flush()  # a stop string cut the text: nothing after it counts
    request.stop_reason = stop_reason
    request.num_stop_held_chars = 0
    return status


def _find_stop(request: Request, stops: tuple[str, ...]) -> str | None:
    """Earliest stop string in the text; the text is cut right before it."""
    longest = max(len(s) for s in stops)
    # only the region the newest token could have completed needs searching
    start = max(0, len(request.text) - request.num_stop_held_chars - longest - 64)
    best: tuple[int, str] | None = None
    for s in stops:
        pos = request.text.find(s, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    if best is None:
        return None
    request.text = request.text[: best[0]]
    return best[1]


def held_chars(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held
