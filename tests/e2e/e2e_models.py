"""The tiny random-weight verifiers of the e2e tests: the package's own maker (:mod:`vllm_hs_compat.reference.models`,
shared with ``vllm-hs-compat demo``), plus the layer ids the tests capture."""

from __future__ import annotations

from vllm_hs_compat.reference.models import (  # noqa: F401 - re-exported for the tests and the engine benchmark
    HEAD_DIM,
    HIDDEN,
    KINDS,
    MAX_POSITIONS,
    NUM_HEADS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    SLIDING_WINDOW,
    VOCAB,
    TinyModel,
    load_model_info,
    make_model,
    make_tokenizer,
)

# Configured out of order on purpose: planes are stored in ascending layer-id order, and each record names its
# own layer ids; the comparison goes by the record's ids.
CAPTURE_LAYER_IDS = (4, 0, 2)

if __name__ == "__main__":
    import sys

    m = make_model(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "dense")
    print(m)
