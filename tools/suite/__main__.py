import sys

from tools.suite.cli import main

sys.exit(main())
