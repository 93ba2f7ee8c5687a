"""Setup of the tools' tests (tests/tools/): the tools on the import path.

The tools (tools/: bench, demo, fuzz, the real-data table) are not
installed with the package; their tests import them from the checkout, so
the repository root goes on sys.path here, for these tests only. The
library's tests (tests/*.py) import nothing from tools/ (test_install checks
the library itself). tests/conftest.py applies here too, and tests/helpers.py
is importable (pytest puts tests/ on sys.path with that conftest).

This folder has no __init__.py on purpose: with one it would be a package
named `tools`, in the way of the tools themselves.
"""

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)
