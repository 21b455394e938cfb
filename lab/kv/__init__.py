"""The model's KV cache in the lab: utility profiler, retention and fidelity checks, needle-QA workloads and
answer scoring (real transformers models)."""
