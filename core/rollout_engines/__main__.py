"""``python -m rollout_engines ...``: the ``rollout-engines`` command, also where no script is on PATH."""

import sys

from .cli import main

sys.exit(main())
