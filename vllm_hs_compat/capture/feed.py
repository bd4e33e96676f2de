"""The capture command's requests into its in-process engine: queued ahead, stepped until a batch's records are read.

``LLM.generate`` runs one batch to its end: the engine's last steps of every batch are part-empty (the batch's tail)
and nothing is queued while the batch's records are flushed and the next batch is read.  On a GPU that is engine
time a plain ``generate`` of all rows never spends.  :class:`EngineFeed` adds requests with the same call
``generate`` makes per prompt and steps the engine itself, so the next batch can be queued before the current one
finishes (:meth:`EngineFeed.submit` ahead, then :meth:`EngineFeed.finish`): vLLM's scheduler takes waiting requests
in arrival order, so a batch still finishes before the one queued after it, and the steps that finish it are filled
with the next one's tokens.  vLLM is reached only through :mod:`vllm_hs_compat.adapters.engine_api` and the
package's connector.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_hs_compat.errors import CaptureFeedError

#: Seconds ``finish`` steps an engine with nothing left to run for the batch's records to be read (``flush``'s).
READ_WAIT_S = 60.0


@dataclass
class Submitted:
    """One batch's requests in the engine: the request id of each sample (None where vLLM refused it, with the
    message in ``refused``), in the batch's order."""

    request_ids: list[str | None]
    refused: dict[int, str] = field(default_factory=dict)


class EngineFeed:
    """Requests into one offline ``LLM`` (in-process engine core: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and its
    steps; finished outputs are kept by request id until :meth:`finish` hands them back.  Not thread-safe: one
    thread submits and steps (the capture command's main thread)."""

    def __init__(self, llm: Any, *, read_wait_s: float = READ_WAIT_S) -> None:
        self.llm = llm
        self.read_wait_s = read_wait_s
        self._ids = itertools.count()
        self._done: dict[str, Any] = {}  # request id -> its final RequestOutput, until finish() takes it
        self.steps = 0
        #: requests queued behind a batch that finished in the steps that finished that batch: the engine ran the
        #: next batch's tokens beside the last of the one before (0 when nothing is queued ahead)
        self.run_ahead = 0

    def submit(self, prompts: Sequence[Mapping[str, Any]], params: Sequence[Any]) -> Submitted:
        """Queue one request per prompt (not run until the engine steps).  A request vLLM refuses (``ValueError``,
        ``TypeError``) is refused alone; the others are queued."""
        from vllm_hs_compat.adapters import engine_api

        sub = Submitted([])
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid = f"hs-capture-{next(self._ids)}"
            try:
                engine_api.add_request(self.llm, rid, prompt, engine_api.final_only(p))
            except (ValueError, TypeError) as exc:
                sub.request_ids.append(None)
                sub.refused[i] = f"{type(exc).__name__}: {exc}"
                continue
            sub.request_ids.append(rid)
        return sub

    def step(self, want: Collection[str] = ()) -> list[str]:
        """One engine step; the outputs it finished are kept (those not in ``want`` counted in ``run_ahead``).
        Returns the request ids it finished."""
        from vllm_hs_compat.adapters import engine_api

        finished: list[str] = []
        for out in engine_api.step(self.llm):
            rid = str(out.request_id)
            self._done[rid] = out
            finished.append(rid)
            if want and rid not in want:
                self.run_ahead += 1
        self.steps += 1
        return finished

    def finish(self, sub: Submitted, on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Step the engine until every request of ``sub`` finished and the connector read its record (requests
        queued after them run in the same steps); their outputs in ``sub``'s order (None where refused).  Their
        record files follow from the connector's publisher thread without more steps.  ``on_done(i, output)``:
        called for each request of ``sub`` (``i``: its place in ``sub``) as soon as the engine finished it, before
        its record is read -- the capture's adopter starts on it while the engine steps on.  Raises
        :class:`~vllm_hs_compat.errors.CaptureFeedError` when the engine holds none of them any more without having
        finished them, or their records stay unread for ``read_wait_s`` of steps after the engine ran out of
        work."""
        from vllm_hs_compat.adapters import engine_api
        from vllm_hs_compat.connector import unread
        from vllm_hs_compat.core.vocabulary import RESULT_KEY

        want = {r for r in sub.request_ids if r is not None}
        place = {r: i for i, r in enumerate(sub.request_ids) if r is not None}
        if on_done is not None:  # finished in the steps of the batch before (queued ahead behind it)
            for r in sorted((r for r in want if r in self._done), key=place.__getitem__):
                on_done(place[r], self._done[r])
        while any(r not in self._done for r in want):
            if not engine_api.has_unfinished(self.llm):
                lost = sorted(r for r in want if r not in self._done)
                raise CaptureFeedError(
                    f"the engine holds no unfinished request, but {len(lost)} queued by the capture feed never "
                    f"finished (first: {lost[0]!r}); was the engine stepped or aborted elsewhere?"
                )
            finished = self.step(want)
            if on_done is not None:
                for r in finished:
                    if r in place:
                        on_done(place[r], self._done[r])
        outs = [None if r is None else self._done.pop(r) for r in sub.request_ids]
        records: list[str] = []  # the connector's record of each request (none where it refused one)
        for out in outs:
            result = {} if out is None else (out.kv_transfer_params or {}).get(RESULT_KEY) or {}
            if result.get("record_id") is not None:
                records.append(str(result["record_id"]))
        deadline: float | None = None
        while unread(records):
            if engine_api.has_unfinished(self.llm):
                deadline = None  # the steps run queued requests as well: no wait is idle
            elif deadline is None:
                deadline = time.monotonic() + self.read_wait_s
            elif time.monotonic() > deadline:
                raise CaptureFeedError(
                    f"{unread(records)} capture record(s) still unread after {self.read_wait_s:.0f} s of engine "
                    "steps with nothing else to run"
                )
            self.step(want)
        return outs
