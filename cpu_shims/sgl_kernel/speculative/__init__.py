"""Stand-in submodule: optional speculative kernels resolve to functions that raise when called."""

from sgl_kernel import __getattr__  # noqa: F401  (same lazy 'raise when used' behaviour)
