"""The user's path, end to end on one machine: ``vllm-hs-compat demo`` (see docs/demo.md).

* :mod:`.engine` -- an in-process vLLM engine with ``extract_hidden_states`` and the capture connector;
* :mod:`.trainer_proc` -- the trainer process: reads the records (capture tree or export), verifies, trains;
* :mod:`.plot` -- the loss plot.

The tools other commands share moved out: the tiny models and the transformers reference to
:mod:`vllm_hs_compat.reference`, the drafter and its acceptance length to :mod:`vllm_hs_compat.drafter` (the old
``demo.models`` / ``demo.reference`` / ``demo.drafter`` / ``demo.acceptance`` names work for one release).

Needs transformers and tokenizers (both come with vLLM) and the ``demo`` extra (rich, Pillow, pyarrow, jinja2).
"""
