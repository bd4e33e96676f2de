"""``vllm-hs-compat capture``: from a dataset to sharded, indexed, resumable capture records (see docs/capture.md)."""
