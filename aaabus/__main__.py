"""``python -m aaabus ...`` is the ``aaabus`` command."""

import sys

from aaabus.cli import main

sys.exit(main())
