"""The old name of plugins/_kit/cbuild.py (examples/README.md and bench/ import it by this name):
the same module."""

import sys

from plugins._kit import cbuild

sys.modules[__name__] = cbuild
