"""pytest hooks for the suite. The helpers that launch real jobs live in tests/helpers.py."""
# Transitional: the benchmark smoke tests still import these from here until their import lines move.
from tests.helpers import BIN, ROOT, launch, mp_env, run_bounded  # noqa: F401
