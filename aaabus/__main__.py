"""``python -m aaabus ...`` is the ``aaabus`` command."""

import sys

from aaabus.tools.cli import main

sys.exit(main())
