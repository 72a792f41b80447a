"""Fakes and helpers for tests and benchmarks, imported as a package (``from tests.support import
pki``): no tests here. Fixtures live in tests/conftest.py."""
