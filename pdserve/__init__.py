"""pdserve: a disaggregated prefill/decode LLM serving cluster.

The subpackages are the repository's top-level folders (``pdserve/engine`` links to
``engine/``, and so on); see docs/architecture.md for what each owns and may import.
"""
