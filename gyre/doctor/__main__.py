"""`python -m gyre.doctor`: see gyre/doctor/__init__.py (or `python -m gyre.doctor --help`)."""

import sys

from gyre.doctor import main

sys.exit(main())
