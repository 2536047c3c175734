"""``python -m mlx_fleet_operator``: same as the ``mlx-fleet-operator`` console script."""

import sys

from mlx_fleet_operator.main import main

sys.exit(main())
