import sys

from .run.cli import main

sys.exit(main())
