"""The test suite: one folder per package, one file per module or per path through the product."""
