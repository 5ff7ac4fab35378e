"""`python -m sweeper.cli ...`: the same as the `sweeper` console script."""

import sys

from sweeper.cli import main

sys.exit(main())
