"""The on-chip tier's tests that ran ahead, in threads (`tests/tpu/ahead.py`):
pytest's call of such a test gives the outcome of that run."""

from tests.tpu import ahead


def pytest_pyfunc_call(pyfuncitem):
  return ahead.call(pyfuncitem)
