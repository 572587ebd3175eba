"""`python -m tokamax_gdn.cli ...`: the `tokamax-gdn` command without the entry point
(e.g. from a source checkout on PYTHONPATH)."""

import sys

from tokamax_gdn.cli import main

sys.exit(main())
