import sys

from mhadsl.cli import main

sys.exit(main())
