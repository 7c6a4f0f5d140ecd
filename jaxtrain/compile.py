"""`jaxtrain.compile`, kept so that `from jaxtrain import compile` keeps working: the code
lives in jaxtrain/planning/compile.py (this module is that one under its old name)."""

import sys

from jaxtrain.planning import compile as _module

sys.modules[__name__] = _module
