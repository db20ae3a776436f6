"""vLLM backend for rollout-engines.

``import rollout_engines_vllm`` is light: vLLM and torch load only when an engine is created
(``rollout_engines.create_engine("vllm", model=...)``).
"""

from __future__ import annotations

__version__ = "0.1.0"
