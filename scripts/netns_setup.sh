#!/usr/bin/env bash
# iproute2 (`ip`, `tc`) for the node-cluster tests and `reshard bench --nodes`
# (reshard/testing/cluster.py): installed with apt-get where it is missing and
# this runs as root; otherwise those tests skip, saying why. Never fails.
set -u
if command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q iproute2 || (apt-get update -q && apt-get install -y -q iproute2)) >/dev/null 2>&1 \
        && exit 0
fi
echo "iproute2 is not installed (apt-get install iproute2, as root): tests/test_cluster.py will skip" >&2
exit 0
