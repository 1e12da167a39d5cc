"""`python -m looped_hf.planner` = `looped-hf plan`."""

import sys

from looped_hf.planner.cli import main

sys.exit(main())
