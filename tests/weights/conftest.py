import sys
from pathlib import Path

# Spawned engine and trainer processes import the helpers by module name.
HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
