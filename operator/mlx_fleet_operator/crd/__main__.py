"""``python -m mlx_fleet_operator.crd``: regenerate the CRDs and field references (see
:mod:`.generate`)."""

import sys

from .generate import main

sys.exit(main())
