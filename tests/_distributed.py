"""experiments/distributed.py loaded as a module once, shared by the sharding tests."""

import importlib.util
import pathlib
import sys

NAME = "specjax_experiments_distributed"
SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "distributed.py"


def load_distributed():
    """experiments/distributed.py (tiny models and the run function), imported once."""
    if NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(NAME, SCRIPT)
        sys.modules[NAME] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[NAME]
