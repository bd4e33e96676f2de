"""The records of one request's choices (``n > 1``): every record a response causes, reachable from that response.

vLLM runs a request with ``n > 1`` as ``n`` child requests, one per choice, and answers with ONE response whose
``kv_transfer_params`` are those of the child that finished last (the others' are dropped; the adapter names the
child-id convention, :meth:`~vllm_hs_compat.adapters.reader.VllmReader.parallel_sampling_child`).  The scheduler
half cannot know ``n`` (each child's sampling params say ``n=1``), nor which child is last.  So every child's
params carry, under :data:`CHOICES_KEY`, the entry of every sibling that finished before it and its own, in
choice order: the last child's (the response's) carry all ``n``.  Each entry is that choice's own ``hs_record``
status and, with the export sink, its own ticket: a capability for its own record only, as for ``n = 1``.

Who is a sibling: a child of the same parent id, with the same arrival time (vLLM copies one processed request
into all children, so they share it to the bit; another request that names itself like a child of this parent
has its own) and the same prompt.  Without an arrival time nothing is grouped (each child reports only itself).

Capture ``"prompt"`` (any record that lies entirely in the prompt): the siblings share the prompt, so its rows are
the same for every choice; the first sibling's record is stored once and the others point at it (status
``"shared"``, ``same_as`` its record id, its ticket).  A record that reaches into generated tokens (``"all"``,
``"output"``, a window past the prompt) differs per choice and is stored per choice.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from vllm_hs_compat.core.vocabulary import CHOICES_KEY  # the kv_transfer_params key of the choices

#: Families remembered (the scheduler never learns when the last child of one has finished).
MAX_FAMILIES: Final = 4096


def _prompt_digest(token_ids: tuple[int, ...], num_prompt_tokens: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(num_prompt_tokens.to_bytes(8, "little"))
    for t in token_ids[:num_prompt_tokens]:
        h.update(t.to_bytes(8, "little", signed=True))
    return h.digest()


@dataclass
class _Family:
    prompt: bytes
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: (start, stop) of a record inside the prompt -> the params of the sibling record that holds it
    prompt_records: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Sibling:
    """One child of an ``n > 1`` request, as :meth:`Choices.join` placed it."""

    key: tuple[str, float]
    index: int


class Choices:
    """The scheduler half's memory of the families of ``n > 1`` requests (bounded: :data:`MAX_FAMILIES`)."""

    def __init__(self, max_families: int = MAX_FAMILIES) -> None:
        self._families: OrderedDict[tuple[str, float], _Family] = OrderedDict()
        self._max = max_families
        self.counters = {"choices_grouped": 0, "choices_shared": 0, "choices_not_grouped": 0}

    def join(
        self,
        child: tuple[str, int] | None,
        arrival_time: float | None,
        token_ids: tuple[int, ...],
        num_prompt_tokens: int,
    ) -> Sibling | None:
        """The family of a finished request: ``child`` is the adapter's ``(parent id, index)`` (None: not a
        child).  None when it is not a child, has no arrival time, or names a parent whose family has another
        prompt (then it is not a sibling: it reports only itself, and is counted)."""
        if child is None:
            return None
        if arrival_time is None:
            self.counters["choices_not_grouped"] += 1
            return None
        parent, index = child
        key = (parent, float(arrival_time))
        prompt = _prompt_digest(token_ids, num_prompt_tokens)
        fam = self._families.get(key)
        if fam is None:
            fam = self._families[key] = _Family(prompt)
            while len(self._families) > self._max:
                self._families.popitem(last=False)
        elif fam.prompt != prompt or index in fam.choices:
            self.counters["choices_not_grouped"] += 1
            return None
        self._families.move_to_end(key)
        self.counters["choices_grouped"] += 1
        return Sibling(key, index)

    def shared_record(self, sib: Sibling, start: int, stop: int) -> dict[str, Any] | None:
        """The params of a sibling's record over prompt positions ``[start, stop)``, if one was scheduled."""
        fam = self._families.get(sib.key)
        return None if fam is None else fam.prompt_records.get((start, stop))

    def remember_prompt_record(self, sib: Sibling, start: int, stop: int, params: Mapping[str, Any]) -> None:
        """A record over prompt positions only was scheduled for ``sib``: later siblings share it."""
        fam = self._families.get(sib.key)
        if fam is not None:
            fam.prompt_records.setdefault((start, stop), dict(params))

    def finish(self, sib: Sibling, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` (this child's own) with :data:`CHOICES_KEY`: the entries of every sibling finished so far,
        this one included, in choice order."""
        fam = self._families.get(sib.key)
        if fam is None:  # forgotten (more than MAX_FAMILIES families in flight): this child only
            fam = _Family(b"")
        fam.choices[sib.index] = {"index": sib.index, **{k: v for k, v in params.items() if k != CHOICES_KEY}}
        return {**params, CHOICES_KEY: [fam.choices[i] for i in sorted(fam.choices)]}
