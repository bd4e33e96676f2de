"""Tiny EAGLE-3 drafters and the acceptance length they earn against its verifier.

* :mod:`.head` -- the drafter head (torch only): the auxiliary planes fused by one linear layer plus the token
  embedding, trained on capture records; saved and loaded as ``drafter.safetensors`` + ``drafter.json``;
* :mod:`.eagle3` -- an EAGLE-3 drafter in vLLM's own checkpoint layout (``LlamaForCausalLMEagle3``), its
  pure-torch forward and training on capture records (``python -m vllm_hs_compat.drafter.eagle3``);
* :mod:`.acceptance` -- mean acceptance length by greedy verification over the verifier's transformers forward
  (``vllm-hs-compat evaluate``; ``--backend vllm`` measures an EAGLE-3 drafter through vLLM's own speculative
  decoding instead; docs/demo.md "Acceptance length").
"""
