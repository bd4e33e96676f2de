"""The user's path, end to end on one machine: ``vllm-hs-compat demo`` (see docs/demo.md).

* :mod:`.models` -- tiny random-weight verifiers made locally (no model hub), shared with the e2e tests;
* :mod:`.reference` -- the transformers forward of the same weights, and the per-plane comparison;
* :mod:`.drafter` -- a tiny EAGLE-3-style drafter head trained on streamed records (torch only);
* :mod:`.engine` -- an in-process vLLM engine with ``extract_hidden_states`` and the capture connector;
* :mod:`.trainer_proc` -- the trainer process: reads records from the export, verifies, trains.

Needs transformers and tokenizers (both come with vLLM) and the ``demo`` extra (rich, Pillow).
"""
