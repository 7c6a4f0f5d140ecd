#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 (JAX >= 0.11 dropped 3.11), or one line saying how to get one.
# Order: $PYTHON, python3.13, python3.12, python3, then pyenv's versions folder. pyenv shims
# exist for versions that are not selected and fail when run, so each candidate is executed.
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
if [ -n "${PYTHON:-}" ]; then
  ok "$PYTHON" && { command -v "$PYTHON" || echo "$PYTHON"; exit 0; }
  echo "PYTHON=$PYTHON is not a working Python >= 3.12" >&2; exit 1
fi
for c in python3.13 python3.12 python3; do
  p=$(command -v "$c" 2>/dev/null) && ok "$p" && { echo "$p"; exit 0; }
done
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for p in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V); do
  ok "$p" && { echo "$p"; exit 0; }
done
echo "no Python >= 3.12 found; install one and run again with PYTHON=/path/to/python3.12" >&2
exit 1
