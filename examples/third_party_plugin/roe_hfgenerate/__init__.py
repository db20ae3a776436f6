"""An example third-party backend: transformers' own ``generate()`` behind the rollout-engines API."""
