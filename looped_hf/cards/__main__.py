"""``python -m looped_hf.cards``: the same as ``looped-hf card``."""

import sys

from .cli import main

sys.exit(main())
