"""``python -m carpool_twin``: see ``carpool_twin.cli``."""

import sys

from carpool_twin.cli import main

sys.exit(main())
