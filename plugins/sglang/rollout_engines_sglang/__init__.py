"""SGLang backend for rollout-engines.

Importing this package imports neither SGLang nor torch; SGLang is imported when an engine is
created (``rollout_engines.create_engine("sglang", model=...)``).
"""

from __future__ import annotations

__version__ = "0.1.0"
