#!/usr/bin/env bash
# What a user does: build the wheel, install it NON-editable into a fresh venv (nothing from
# the source tree on the path), then run the daemon and the client commands from that venv.
# Called by .ci/run; needs only .venv (for the build) and pip's index for the dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
work=$(mktemp -d /tmp/kvo-wheel-XXXXXX)
pool=/dev/shm/kvoffload-wheel-smoke-$$
daemon=
cleanup() {
  if [ -n "$daemon" ] && kill -0 "$daemon" 2>/dev/null; then kill -KILL "$daemon" || true; fi
  rm -rf "$work" "$pool"
}
trap cleanup EXIT
.venv/bin/python -m pip wheel --no-deps --no-build-isolation -q -w "$work/dist" .
"$PY" -m venv "$work/venv"
pip() {
  "$work/venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v '^WARNING: Location' || true; }
}
# CPU torch first, as scripts/setup.sh does: a bare requirement would pull the CUDA build.
pip install "torch==$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')"
pip install "$work"/dist/kvoffload-*.whl
bin=$work/venv/bin
# Run from an empty folder: the source tree must not be importable.
cd "$work"
"$bin/python" -c 'import kvoffload.daemon.tiers, kvoffload.daemon.store.eviction, sys
assert "/venv/" in kvoffload.daemon.tiers.__file__, kvoffload.daemon.tiers.__file__'
ctl="ipc://$work/control.sock"
"$bin/kvoffload" serve --control "$ctl" --http 127.0.0.1:0 --pool-path "$pool" \
  --pool-bytes 64MiB --events "tcp://127.0.0.1:0" --ready-file "$work/ready.json" \
  --log-level warning 2>"$work/daemon.log" &
daemon=$!
for _ in $(seq 1 300); do
  [ -s "$work/ready.json" ] && break
  kill -0 "$daemon" 2>/dev/null || { cat "$work/daemon.log" >&2; exit 1; }
  sleep 0.1
done
[ -s "$work/ready.json" ] || { echo "wheel smoke: daemon not ready in 30 s" >&2; exit 1; }
field() { "$bin/python" -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" \
  "$work/ready.json" "$1"; }
http=$(field http)
events=$(field events)
# A bounded tail in the background: it must see the demo's events.
timeout 60 "$bin/kvoffload" events tail --endpoint "$events" --count 5 --json \
  >"$work/tail.out" 2>"$work/tail.err" &
tail_pid=$!
sleep 0.5  # the SUB's subscription reaches the PUB (no event carries a handshake)
"$bin/kvoffload" demo --connect "$ctl" --requests 40
"$bin/kvoffload" stats --connect "$ctl" --http "$http"
wait "$tail_pid" || { echo "wheel smoke: events tail failed" >&2; cat "$work/tail.err" >&2; exit 1; }
[ "$(wc -l <"$work/tail.out")" -ge 5 ] || { echo "wheel smoke: no events seen" >&2; exit 1; }
kill -TERM "$daemon"
wait "$daemon"
daemon=
[ ! -e "$pool" ] || { echo "wheel smoke: pool file left behind" >&2; exit 1; }
echo "wheel smoke: installed wheel serves, demo, stats and events tail work"
