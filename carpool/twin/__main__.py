"""``python -m carpool.twin``: see ``carpool.twin.cli``."""

import sys

from carpool.twin.cli import main

sys.exit(main())
