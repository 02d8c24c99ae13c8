import sys

from spark_server.cli import main

sys.exit(main())
