"""vLLM's in-tree ``ExampleHiddenStatesConnector`` made to run on the CPU platform (test and benchmark only).

On CPU the example's save path dies: it allocates its host copy with ``pin_memory=True`` (no pinned allocator
without an accelerator) and orders the copy with a CUDA stream and CUDA events (placeholders without ``query`` /
``wait_event`` on CPU).  On CPU the copy is synchronous, so every event is complete as soon as it is recorded and
no stream is needed.  This subclass supplies exactly those stand-ins for the duration of the example's own save
method; everything else (which group, which block ids, the slot arithmetic, the file format) stays vLLM's.

Load with ``kv_connector="CpuExampleHiddenStatesConnector"``, ``kv_connector_module_path="e2e_example_cpu"``
(this directory on ``PYTHONPATH``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)


class _CompletedEvent:
    """A CUDA-event stand-in for synchronous CPU copies: recorded means done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoStream:
    """A CUDA-stream stand-in: CPU work is ordered by program order already."""

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def cpu_stand_ins() -> Iterator[None]:
    """While active: ``torch.cuda.Event`` is always complete, ``torch.cuda.stream(...)`` does nothing and
    ``pin_memory=True`` is dropped from ``torch.empty_like``."""
    saved_event, saved_stream, saved_empty_like = torch.cuda.Event, torch.cuda.stream, torch.empty_like

    def empty_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        return saved_empty_like(*args, **kwargs)

    torch.cuda.Event = _CompletedEvent  # type: ignore[misc,assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.empty_like = empty_like  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.Event, torch.cuda.stream, torch.empty_like = saved_event, saved_stream, saved_empty_like  # type: ignore[misc]


class CpuExampleHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _get_copy_stream(self) -> Any:
        return _NoStream()

    def _submit_async_write(self, *args: Any, **kwargs: Any) -> Any:
        with cpu_stand_ins():
            return super()._submit_async_write(*args, **kwargs)

    def get_finished(self, *args: Any, **kwargs: Any) -> Any:
        # Copy events recorded under the stand-ins are polled here.
        with cpu_stand_ins():
            return super().get_finished(*args, **kwargs)
