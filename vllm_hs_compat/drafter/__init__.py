"""A tiny EAGLE-3-style drafter and the acceptance length it earns against its verifier.

* :mod:`.head` -- the drafter head (torch only): the auxiliary planes fused by one linear layer plus the token
  embedding, trained on capture records; saved and loaded as ``drafter.safetensors`` + ``drafter.json``;
* :mod:`.acceptance` -- mean acceptance length by greedy verification over the verifier's transformers forward
  (``vllm-hs-compat evaluate``; docs/demo.md "Acceptance length" says why a simulation).
"""
