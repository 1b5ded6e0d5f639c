"""`python -m radixgen.serve [--model PATH] [--host H] [--port P] ...`: the HTTP server."""

import sys

from radixgen.runtime.server.launch import main

if __name__ == "__main__":
    sys.exit(main())
