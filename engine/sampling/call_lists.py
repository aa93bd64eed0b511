"""Tool-call lists in grammar-held output: where a list's calls are, and the rule that ends a list at its first
repeated call.

A tool-call grammar (router/openai/tools.py) lets a list of calls go on for as long as the model writes calls:
the generic format's ``{"tool_calls":[…]}`` and vLLM's ``required`` array. Asked for one call (pydantic-ai's
output tool, ``tool_choice: "required"``), SmolLM2 writes it, a few more, then the same call again and again until
max_tokens cuts the list (docs/benchmarks.md, "Tool-call lists that repeat"). The rule, measured there against a
bound on the list's length: **a list ends at the first call identical to an earlier call of the list** — the same
text, which under the grammar's compact JSON means the same name and arguments. No JSON Schema can say it
(llguidance refuses ``uniqueItems``), so :class:`RepeatGuard` applies it on top of llguidance's mask, token by
token:

- while the call being written is still a prefix of an earlier call E, a token that would complete E may not go on
  past it (``}},{"`` would write the repeat and open another call in one step): it must end with E, or with the
  list's closing after it;
- once the call written equals E, only the list's closing may follow (``]``, then ``}`` for the generic format's
  object), then EOS: the request ends with finish_reason ``stop``; the router drops the repeat and counts it
  (router/openai/assistant_message.py, ``duet_tool_calls_dropped_total{reason="repeat"}``).

Distinct calls go on (the weather in Paris, then in Oslo: one tool, other arguments). Not caught here: a repeat
whose arguments differ only in key order or escapes (the router still drops it), and a call no longer than one
token (none is: the shortest, ``{"name":"f","arguments":{}}``, is 29 characters). The state is a function of the
output tokens, like llguidance's, so a matcher rebuilt after a handoff or a migration agrees; speculative decoding
rolls both back together (:meth:`RepeatGuard.rollback`).

:class:`ListScanner` finds a list's items in text as it arrives; the router reads the complete calls of a list
that max_tokens cut with it.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.request import StructuredOutput

log = logging.getLogger(__name__)

_LAST_CHAR = "\U0010ffff"  # sorts after every character: prefix + it bounds the strings that start with prefix


@dataclass(frozen=True)
class CallListOutput(StructuredOutput):
    """A ``json_schema`` output whose document holds a list of tool calls, ended at its first repeated call.
    ``list_depth``: 0, the document is the list (vLLM's ``required`` array); 1, the list is a value of the root
    object (the generic format's ``{"tool_calls": [...]}``)."""

    list_depth: int = 0


class ListScanner:
    """The items of a document's list as its text arrives: the list is the first array opened at container depth
    ``list_depth``. Any text whose JSON structure is ASCII: the router feeds decoded text, the engine token bytes
    read as latin-1 (one character per byte)."""

    def __init__(self, list_depth: int) -> None:
        self.list_depth = list_depth
        self.depth = 0
        self.in_string = self.escaped = False
        self.state = "before"  # before | open | closed
        self.item: str | None = None  # the item being written, from its first character
        self.items: list[str] = []

    @property
    def closed(self) -> bool:
        return self.state == "closed"

    def feed(self, text: str) -> list[str]:
        """The items ``text`` completes, in order."""
        done: list[str] = []
        for c in text:
            self._step(c, done)
        return done

    def _step(self, c: str, done: list[str]) -> None:
        if self.in_string:
            if self.item is not None:
                self.item += c
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
            return
        level = self.list_depth + 1  # the list's own level: between items, or in a scalar item
        if self.state == "open" and self.depth == level:
            if c in ",]" or c.isspace():
                if self.item is not None:
                    self._done(done)
                if c == "]":
                    self.depth, self.state = self.depth - 1, "closed"
                return
            if self.item is None:
                self.item = ""
        if self.item is not None:
            self.item += c
        if c == '"':
            self.in_string = True
        elif c in "{[":
            if c == "[" and self.state == "before" and self.depth == self.list_depth:
                self.state = "open"
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.state == "open" and self.depth == level and self.item is not None:
                self._done(done)

    def _done(self, done: list[str]) -> None:
        self.items.append(self.item)
        done.append(self.item)
        self.item = None

    def snapshot(self) -> tuple:
        return self.depth, self.in_string, self.escaped, self.state, self.item, len(self.items)

    def restore(self, snap: tuple) -> None:
        self.depth, self.in_string, self.escaped, self.state, self.item, num_items = snap
        del self.items[num_items:]


class TokenTable:
    """A vocabulary's spellings as the repeat rule reads them: latin-1 text per id (empty for special tokens, which
    never spell grammar text), sorted for prefix look-ups. Built once per grammar backend (~50 ms for 49k ids)."""

    def __init__(self, token_bytes: Sequence[bytes], special_ids: Iterable[int]) -> None:
        special = set(special_ids)
        self.text = [b.decode("latin-1") if i not in special else "" for i, b in enumerate(token_bytes)]
        order = sorted((t, i) for i, t in enumerate(self.text) if t)
        self.sorted_text = [t for t, _ in order]
        self.sorted_ids = [i for _, i in order]
        self.max_len = max(map(len, self.sorted_text))
        self.max_len_from: dict[str, int] = {}  # by first character: ``"`` and ``}`` start no token over 4 long
        for t in self.sorted_text:
            self.max_len_from[t[0]] = max(self.max_len_from.get(t[0], 0), len(t))

    def with_prefix(self, prefix: str) -> Iterable[tuple[str, int]]:
        """(spelling, id) of every token that starts with ``prefix``."""
        lo = bisect.bisect_left(self.sorted_text, prefix)
        hi = bisect.bisect_left(self.sorted_text, prefix + _LAST_CHAR, lo)
        return zip(self.sorted_text[lo:hi], self.sorted_ids[lo:hi])

    def spelling(self, text: str) -> list[int]:
        """The ids spelled exactly ``text``."""
        return [i for t, i in self.with_prefix(text) if t == text]


class RepeatGuard:
    """The repeat rule for one request (the module docstring): fed the tokens the grammar accepted, it narrows the
    grammar's next-token masks."""

    def __init__(self, table: TokenTable, list_depth: int) -> None:
        self.table = table
        self.scan = ListScanner(list_depth)
        self.closing = "]" + "}" * list_depth  # what closes the list and the document after an item
        self.ending: str | None = None  # after a repeat: the closing still to write
        self._history: list[tuple] = []

    @property
    def ended(self) -> bool:
        return self.ending is not None

    def accept(self, token_id: int) -> None:
        self._history.append((self.scan.snapshot(), self.ending))
        text = self.table.text[token_id]
        if self.ending is not None:
            self.ending = self.ending[len(text):]  # the mask allowed only a prefix of it
            return
        for item in self.scan.feed(text):
            if item in self.scan.items[:-1]:
                # what the token wrote past the repeat was a prefix of the closing (the mask saw to it)
                still_open = not self.scan.closed
                self.ending = "]" * still_open + "}" * (self.scan.depth - still_open)
                return

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens."""
        if num_tokens <= 0:
            return
        snap, self.ending = self._history[-num_tokens]
        self.scan.restore(snap)
        del self._history[-num_tokens:]

    def restrict(self, bitmask_row: np.ndarray) -> None:
        """Clear, in the grammar's mask ([words] int32, bit t = token t), the tokens the rule forbids next."""
        if self.ending is not None:
            if self.ending:
                self._keep_only(bitmask_row, [i for n in range(1, len(self.ending) + 1)
                                              for i in self.table.spelling(self.ending[:n])])
            return
        current, earlier = self.scan.item, self.scan.items
        if current is None or not earlier or self.scan.closed:
            return
        forbidden, at = [], len(current)
        for call in earlier:  # distinct: a repeat ends the list
            if len(call) <= at or len(call) - at > self.table.max_len_from.get(call[at], 0) \
                    or not call.startswith(current):
                continue  # no token could complete this call from here
            rest = call[at:]
            for spelling, token_id in self.table.with_prefix(rest):
                past = spelling[len(rest):]
                if past and not self.closing.startswith(past):
                    forbidden.append(token_id)
        if forbidden:
            words = bitmask_row.view(np.uint32)
            for token_id in forbidden:
                words[token_id >> 5] &= np.uint32(~(1 << (token_id & 31)) & 0xFFFFFFFF)

    def _keep_only(self, bitmask_row: np.ndarray, token_ids: list[int]) -> None:
        words = bitmask_row.view(np.uint32)
        keep = np.zeros_like(words)
        for token_id in token_ids:
            keep[token_id >> 5] |= np.uint32(1 << (token_id & 31))
        if not (words & keep).any():  # the grammar allows none of the closing tokens: impossible short of a bug
            log.warning("the repeat rule found no closing token the grammar allows; the list is left open")
            return
        words &= keep
