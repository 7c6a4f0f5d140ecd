#!/usr/bin/env bash
# Best effort, called by `make venv`: copy gperftools' tcmalloc (Debian's
# libtcmalloc-minimal4) into DEST, where jaxtrain's CLI preloads it for CPU runs
# (jaxtrain/host_malloc.py). `apt-get download` needs no root and installs nothing
# system-wide. Where it cannot be had (no apt, no package lists, no network), CPU runs
# keep glibc's tuned heap and this says so; it never fails the install.
set -u
dest="${1:?usage: fetch_tcmalloc.sh DEST_DIR}"
lib=libtcmalloc_minimal.so.4
if [ -f "$dest/$lib" ]; then exit 0; fi
if [ "$(uname -s)" != Linux ] || ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "tcmalloc: not fetched (needs apt-get and dpkg-deb); CPU runs use glibc's tuned heap"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
if (cd "$tmp" && apt-get download -q libtcmalloc-minimal4 >"$tmp/log" 2>&1) \
  && dpkg-deb -x "$tmp"/libtcmalloc-minimal4_*.deb "$tmp/root"; then
  found="$(find "$tmp/root" -name 'libtcmalloc_minimal.so.4.*' ! -name '*debug*' | head -1)"
  if [ -n "$found" ]; then
    mkdir -p "$dest" && cp "$found" "$dest/$lib" && echo "tcmalloc: $dest/$lib (for CPU runs of the CLI)"
    exit 0
  fi
fi
echo "tcmalloc: not fetched (apt-get download libtcmalloc-minimal4 failed: $(tail -1 "$tmp/log" 2>/dev/null)); CPU runs use glibc's tuned heap"
exit 0
