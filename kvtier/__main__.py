import sys

from kvtier.cli import main

sys.exit(main())
