#!/usr/bin/env bash
# Sets up .venv-dynamo: NVIDIA Dynamo's runtime wheel (ai-dynamo-runtime, ~75 MB) with its
# standalone KV indexer (`python -m dynamo.indexer`), which the router tests run against the
# daemon (tests/events/test_dynamo_indexer.py, docs/routers.md). A separate venv because the wheel
# pins pydantic<=2.13.5, which conflicts with vLLM's. Idempotent; a few seconds when the wheel
# is cached. KVOFFLOAD_SKIP_DYNAMO=1 skips it (those tests then skip with that reason).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${KVOFFLOAD_SKIP_DYNAMO:-0}" != 1 ] || { echo "setup_dynamo: skipped (KVOFFLOAD_SKIP_DYNAMO=1)" >&2; exit 0; }
VERSION=1.6.1  # the version docs/routers.md and docs/events.md were checked against
VENV=${KVOFFLOAD_DYNAMO_VENV:-.venv-dynamo}
if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('ai-dynamo-runtime') != '$VERSION')" 2>/dev/null; then
  exit 0
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install "ai-dynamo-runtime==$VERSION"
"$VENV/bin/python" -m dynamo.indexer --help >/dev/null
echo "setup_dynamo: $VENV has ai-dynamo-runtime $VERSION" >&2
