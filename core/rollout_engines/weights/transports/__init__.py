"""Weight transports that ship with the core. Each is registered by the core's plugin through
``register_transports``, exactly as a third party's transport would be."""
