"""``python -m node_agent``: run the node agent (see :mod:`node_agent.main`)."""

import sys

from .main import main

sys.exit(main())
