import sys

from sglang_pdd.chaos.cli import main

sys.exit(main())
