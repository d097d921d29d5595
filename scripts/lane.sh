#!/usr/bin/env bash
# One lane of `make test`, and the summary of all of them.
#
#   scripts/lane.sh NAME CMD...    run CMD; its output goes to the terminal and
#                                  to $LANE_DIR/NAME.log, its exit status and
#                                  seconds to $LANE_DIR/NAME.rc
#   scripts/lane.sh --summary RC LANE...
#                                  every lane's status and time, every FAILED /
#                                  ERROR line of the lanes that failed, and the
#                                  lanes that never ran (make's status RC)
#
# `make test` runs the lanes with `make -k`, so one failing lane does not stop
# the others, and prints the summary last with make's exit status kept.
set -uo pipefail
dir=${LANE_DIR:-.test-lanes}
if [ "${1:-}" = "--summary" ]; then
  make_rc=$2
  shift 2
  failed=0
  echo "== make test: lanes =="
  for name in "$@"; do
    rc_file="$dir/$name.rc"
    if [ ! -e "$rc_file" ]; then
      failed=1
      echo "  NOT RUN $name (a step before it failed: see above)"
      continue
    fi
    read -r rc secs < "$rc_file"
    if [ "$rc" = 0 ]; then
      echo "  ok      $name (${secs} s)"
    else
      failed=1
      echo "  FAILED  $name (exit $rc, ${secs} s)"
      grep -E "^(FAILED|ERROR) |^[^ ]+:[0-9]+:[0-9]+: [A-Z]+[0-9]+|^Found [0-9]+ error|^Would reformat|error:" "$dir/$name.log" \
        | head -40 | sed 's/^/            /'
    fi
  done
  if [ "$failed" = 0 ] && [ "$make_rc" = 0 ]; then
    echo "  every lane passed"
  elif [ "$failed" = 0 ]; then
    echo "  make failed outside the lanes (exit $make_rc): see above"
  fi
  exit 0
fi
name=$1
shift
mkdir -p "$dir"
start=$(date +%s)
"$@" 2>&1 | tee "$dir/$name.log"
rc=${PIPESTATUS[0]}
echo "$rc $(( $(date +%s) - start ))" > "$dir/$name.rc"
exit "$rc"
