import sys

from dualpipe_kernels.cli import main

sys.exit(main())
