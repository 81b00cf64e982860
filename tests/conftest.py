"""Test-session settings shared by every tests/test_*.py.

Inductor's on-disk graph cache keys a graph by its ops and shapes, not by the Python fake
implementations of tequant's ops, so a cache written by another checkout (or an older commit)
could replay output asserts that no longer hold: each test session gets a cache of its own.
"""
import os
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="tequant-inductor-"))
