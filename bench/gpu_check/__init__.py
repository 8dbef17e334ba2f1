"""``python -m pdserve.bench.gpu_check``: the engine on a GPU against transformers, with no
model files: seeded random weights in SmolLM2-135M's shape and a 1B Llama shape, built as
``LlamaForCausalLM`` and loaded into the engine from memory. Correctness (logits, greedy
tokens under every engine technique), then speed (throughput against transformers, decode
step time against the device's memory-bandwidth floor). ``--tiny`` runs the same code at
toy sizes, on the CPU when there is no GPU (the test suite does)."""
