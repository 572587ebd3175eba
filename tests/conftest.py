"""Test configuration: CPU only, no network lookups from libtpu, and libtpu
loadable by several processes at once (pytest-xdist workers each compile for
TPU targets ahead of time)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
