"""``python -m mha.cli ...``: the same as the ``mha`` command."""

import sys

from mha.cli import main

sys.exit(main())
