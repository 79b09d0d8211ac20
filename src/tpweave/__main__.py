import sys

from tpweave.cli import main

sys.exit(main())
