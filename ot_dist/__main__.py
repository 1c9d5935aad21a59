import sys

from ot_dist.cli import main

sys.exit(main())
