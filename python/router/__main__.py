"""`python -m radixgen.router --worker-urls URL ...`."""

import sys

from radixgen.router.launch import main

if __name__ == "__main__":
    sys.exit(main())
