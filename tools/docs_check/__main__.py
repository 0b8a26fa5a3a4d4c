import sys

from tools.docs_check.runner import main

sys.exit(main())
