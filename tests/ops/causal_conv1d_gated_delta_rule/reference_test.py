"""The reference serving op against tokamax's references (test_base)."""

from .test_base import ServingTestBase  # pylint: disable=relative-beyond-top-level


class TestReference(ServingTestBase):
  IMPL = "reference"
  PROPERTIES = False
