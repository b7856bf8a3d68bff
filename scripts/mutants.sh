#!/usr/bin/env bash
# Remove each byte-correctness guard in a scratch copy; the tests that cover it must fail.
# See scripts/mutants.py. Usage: bash scripts/mutants.sh [-k NAME]
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/mutants.py "$@"
