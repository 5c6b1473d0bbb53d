"""``python -m loadtest ...``: see `loadtest.cli`."""

import sys

from loadtest.cli import main

sys.exit(main())
