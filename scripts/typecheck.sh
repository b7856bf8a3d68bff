#!/usr/bin/env bash
# mypy over every package under its import name (kvoffload.daemon, kvoffload.connector, ...),
# and over tests/ (the package `tests`, as pytest imports it).
#
#   bash scripts/typecheck.sh                     # everything (what CI runs)
#   bash scripts/typecheck.sh daemon/config.py tests/events   # some files or folders (repo paths)
#   bash scripts/typecheck.sh --strict-equality   # options go to mypy
#
# Why a script: the import names map to top-level folders (daemon/ -> kvoffload.daemon, see
# ROOTS in setup.py), which setuptools' editable finder resolves at run time but mypy cannot
# follow (it reads no import hooks, and has no setting that renames a folder into a package).
# `mypy daemon` checks daemon/ as a package named `daemon`, and every `from kvoffload.daemon...`
# in it is unresolved. So this builds, in a temporary folder, the tree the wheel installs:
# kvoffload/ holding symlinks to kvoffload/'s own entries and to each mapped folder, and checks
# it with that folder on MYPYPATH. Symlinks: nothing is copied, so mypy reads the files being
# edited, from a fresh clone, with no install and no build. Rejected: checking the installed
# wheel's site-packages copy (needs a build first, and errors would point at copies) and
# setuptools' strict editable mode (a link tree too, but frozen at install time: new modules
# are missed until a reinstall). mypy reports paths inside the temporary tree; they are
# rewritten back to repo paths, so editors and readers see daemon/config.py:12.
# tests/ needs no link: it is imported as `tests.*` from the repo root, which mypy searches
# (the working directory), so it is checked in place; its kvoffload.* imports resolve to the
# tree, which MYPYPATH puts first.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MYPY=${MYPY:-$REPO/.venv/bin/mypy}
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3

# A fixed place, not a fresh temp folder: mypy's cache keeps each module's path and replays
# its errors under that path while the file is unchanged, so a new tree each run would report
# stale paths. .mypy_cache/ is git-ignored and skipped by ruff and pytest.
TREE=.mypy_cache/kvoffload-tree
mkdir -p "$TREE/kvoffload"

# The mapping is read from setup.py (the one source the wheel is built from), not repeated here.
mapfile -t ROOTS < <("$PY" - <<'EOF'
import ast
tree = ast.parse(open("setup.py").read())
roots = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             and any(getattr(t, "id", None) == "ROOTS" for t in n.targets))
for name, folder in roots.items():
    print(name, folder)
EOF
)
[ "${#ROOTS[@]}" -gt 1 ] || { echo "typecheck: no ROOTS read from setup.py" >&2; exit 2; }

# Links are (re)made in place (ln -sfn: idempotent, so runs side by side do not clash) and
# leftovers of removed entries are dropped.
want=()
for entry in kvoffload/*; do
  [ "$(basename "$entry")" = __pycache__ ] && continue
  ln -sfn "$REPO/$entry" "$TREE/kvoffload/"
  want+=("$(basename "$entry")")
done
SED=()  # tree path -> repo path, the sub-packages before kvoffload/ itself
for line in "${ROOTS[@]}"; do
  read -r name folder <<<"$line"
  [ "$name" = kvoffload ] && continue
  sub=${name#kvoffload.}
  if [ -e "kvoffload/$sub" ]; then
    echo "typecheck: kvoffload/$sub exists and $name maps to $folder/" >&2; exit 2
  fi
  ln -sfn "$REPO/$folder" "$TREE/kvoffload/$sub"
  want+=("$sub")
  SED+=(-e "s#$TREE/kvoffload/$sub/#$folder/#g")
done
for link in "$TREE"/kvoffload/*; do
  [[ " ${want[*]} " == *" $(basename "$link") "* ]] || rm -f "$link"
done
SED+=(-e "s#$TREE/kvoffload/#kvoffload/#g")

# Repo paths given on the command line -> the same files inside the tree.
flags=()  # mypy options pass through (e.g. --warn-unused-ignores)
targets=()
for arg in "$@"; do
  case "$arg" in -*) flags+=("$arg"); continue ;; esac
  rel=${arg#./}
  # tests/ is checked where it is (see the header); its folders have __init__.py files, so
  # mypy names the files tests.<...> from the repo root.
  if [ "$rel" = tests ] || [ "${rel#tests/}" != "$rel" ]; then targets+=("$rel"); continue; fi
  mapped=
  for line in "${ROOTS[@]}"; do
    read -r name folder <<<"$line"
    if [ "$rel" = "$folder" ] || [ "${rel#"$folder"/}" != "$rel" ]; then
      sub=${name#kvoffload}; sub=${sub#.}
      mapped=$TREE/kvoffload${sub:+/$sub}${rel#"$folder"}
      break
    fi
  done
  [ -n "$mapped" ] || { echo "typecheck: $arg is not under a package folder" >&2; exit 2; }
  targets+=("$mapped")
done
# Where vLLM is not installed (KVOFFLOAD_SKIP_VLLM=1) its imports are Any, so the ignores its
# types make necessary read as unused: only a venv with vLLM (CI's) checks for unused ignores.
# An option given here still wins (it comes later).
if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("vllm") is None)' 2>/dev/null
then
  echo "typecheck: vLLM is not installed: unused type-ignores are not reported" >&2
  flags=(--no-warn-unused-ignores ${flags[@]+"${flags[@]}"})
fi
# Packages, not paths: mypy takes either, not both, and -p names every module the same way.
[ "${#targets[@]}" -gt 0 ] || targets=(-p kvoffload -p tests)

set +e
MYPYPATH=$TREE${MYPYPATH:+:$MYPYPATH} "$MYPY" --explicit-package-bases ${flags[@]+"${flags[@]}"} \
  "${targets[@]}" \
  | sed "${SED[@]}"
rc=${PIPESTATUS[0]}
exit "$rc"
