"""Test suite (a package, so tests can share helpers from tests/conftest.py)."""
