import sys

from sppo_fx.cli import main

sys.exit(main())
