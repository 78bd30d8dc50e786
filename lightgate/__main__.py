import sys

from lightgate.cli import main

sys.exit(main())
