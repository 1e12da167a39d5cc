"""`python -m looped_hf.sweep ...`: the same command as `looped-hf sweep ...`."""

import sys

from looped_hf.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
