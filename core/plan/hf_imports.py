"""transformers' start-up cost in this project's own processes (issue 37, the cold start).

transformers (5.x) reads a model's config through classes whose validation imports its image
and video utilities, and those import torchvision when it is installed; torchvision imports
torch._dynamo. On the H100 image (bench/RESULTS.md, session 27) that chain cost ~5 s in each of
the two processes a cold `core serve` waits for: the server, which resolves the plan, and the
engine worker. Serving text needs none of it, so the `core` command and the engine worker
processes hide torchvision before transformers is first imported: `import torchvision` fails
there and `importlib.util.find_spec("torchvision")` is None, which transformers takes as "not
installed". A library user's own process (`core.Engine` in a script) is left alone.
CORE_TORCHVISION=1 keeps torchvision importable everywhere.
"""

from __future__ import annotations

import os
import sys

ENV = "CORE_TORCHVISION"


def keep_torchvision_out() -> bool:
    """Hide torchvision from this process (see the module docstring) unless CORE_TORCHVISION=1
    or it is already imported. Returns whether it is hidden now."""
    if os.environ.get(ENV) == "1":
        return False
    if sys.modules.get("torchvision", 0) is None:
        return True  # hidden already
    if "torchvision" in sys.modules:
        return False  # imported already: nothing to save, and code may be using it
    sys.modules["torchvision"] = None  # find_spec gives None; `import torchvision` raises
    return True
