"""`python -m radixgen.serve [flags]`: the HTTP server, the same as `radixgen serve` (see --help)."""

import sys

from radixgen.runtime.server.launch import main

if __name__ == "__main__":
    sys.exit(main())
