"""`python -m launch ...` is the same as `simloop ...`."""

from launch.cli import main

raise SystemExit(main())
