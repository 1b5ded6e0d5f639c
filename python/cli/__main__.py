"""`python -m radixgen.cli ...`: the same as the `radixgen` console script."""

from radixgen.cli import main

raise SystemExit(main())
