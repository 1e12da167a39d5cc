import sys

from looped_hf.cli import main

sys.exit(main())
