"""`python -m atlas COMMAND ...`: the `atlas` console script (atlas.commands)."""

import sys

from .commands import main

sys.exit(main())
