"""``python -m rollout_engines_remote.server ...``: the same as ``rollout-engines serve ...``."""

import sys

from .cli import main

sys.exit(main())
