"""`python -m hicache` runs the same CLI as the `hicache` console script."""

from hicache.cli import main

raise SystemExit(main())
