import sys

from mtpstate.tools.cli import main

sys.exit(main())
