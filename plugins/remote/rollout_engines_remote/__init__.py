"""rollout-engines over HTTP.

- :mod:`.server`: ``rollout-engines serve`` puts any installed backend behind FastAPI (OpenAI-compatible
  completions, a token-in/token-out ``/generate``, the control plane, Prometheus metrics).
- :mod:`.client`: the ``remote`` backend, which makes such a server (or a plain vLLM / SGLang server)
  look like a local engine.
- :mod:`.transport`: the ``http`` weight transport.

Importing this package imports neither FastAPI nor httpx.
"""

__version__ = "0.1.0"
