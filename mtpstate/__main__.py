import sys

from mtpstate.cli import main

sys.exit(main())
