#!/bin/sh
# gateway-check.sh: fails if a file of the core other than src/core/backend.c reaches into the
# backend table (`be->entry`, `->be->entry`). Every call through the table must take its wrapper
# in backend.c, which injects faults, falls back and marks lost devices (src/backend.h).
# Usage: gateway-check.sh <source dir>
src=${1:?usage: gateway-check.sh <source dir>}
hits=$(grep -nE '(^|[^A-Za-z0-9_])be->' "$src"/src/core/*.c "$src"/src/core/*.h |
       grep -v '^[^:]*/src/core/backend\.c:')
if [ -n "$hits" ]; then
  echo "calls through the backend table outside src/core/backend.c:"
  echo "$hits"
  exit 1
fi
# The check itself must see the gateway's own calls, or the pattern has gone stale.
grep -qE '(^|[^A-Za-z0-9_])be->' "$src"/src/core/backend.c || {
  echo "gateway-check.sh: the pattern matches nothing in src/core/backend.c"
  exit 1
}
echo "only src/core/backend.c calls through the backend table"
