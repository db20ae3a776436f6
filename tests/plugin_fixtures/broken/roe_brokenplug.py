"""A plugin whose import fails, used by the registry tests."""
raise RuntimeError("boom: this plugin is broken on purpose")
