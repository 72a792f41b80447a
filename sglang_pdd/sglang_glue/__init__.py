"""Everything that touches SGLang internals lives here (plugin entry point, hooks, servers)."""
