"""``python -m mlx_fleet_router``: :func:`mlx_fleet_router.main.main`."""

import sys

from .main import main

sys.exit(main())
