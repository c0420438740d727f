"""``python -m fp4vis.cli`` (torchrun, accelerate launch): the ``fp4vis`` command."""

import sys

from fp4vis.cli import main

sys.exit(main())
