"""`jaxtrain.convert`, kept so that `from jaxtrain.convert import hf_to_ckpt` keeps working:
the code lives in jaxtrain/interchange/convert.py (this module is that one under its old name)."""

import sys

from jaxtrain.interchange import convert as _module

sys.modules[__name__] = _module
