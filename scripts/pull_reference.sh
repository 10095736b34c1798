#!/bin/sh
# Pull a frozen reference (freeze's outputs, and prepare's that it was made from) from the default DVC
# remote, so that this machine re-runs only the trials: `dvc repro` then finds freeze unchanged and skips it.
#
# `dvc pull` alone prints a traceback-like ERROR block and exits 1 when the remote does not answer; this
# wrapper turns any failure into ONE line and exit 2 (the pipeline's bad-input convention), and removes
# what a failed pull may have checked out, so nothing half-pulled is left in data/. A remote that hangs
# is stopped after DVC_PULL_TIMEOUT seconds (default 600).
#
#   sh scripts/pull_reference.sh            # from the repository root; uses the default remote
set -u
DVC=${DVC:-dvc}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
remote=$($DVC remote default 2>/dev/null)
if [ -z "$remote" ]; then
  echo "error: no default DVC remote to pull the reference from; add one: dvc remote add -d NAME URL (docs/distributed.md)" >&2
  exit 2
fi
had=""
for out in data/reference data/prepared; do
  [ -e "$out" ] && had="$had $out"
done
if timeout "${DVC_PULL_TIMEOUT:-600}" $DVC pull prepare freeze >"$log" 2>&1; then
  cat "$log"
  exit 0
fi
status=$?
for out in data/reference data/prepared; do
  case " $had " in
    *" $out "*) ;;  # it was there before: never deleted here
    *) rm -rf "$out" ;;  # a failed pull leaves nothing half-checked-out
  esac
done
if [ "$status" -eq 124 ]; then
  reason="no answer within ${DVC_PULL_TIMEOUT:-600} s"
else
  reason=$(grep -A1 -m1 -E "ERROR|error" "$log" | tr "\n" " " | sed "s/^ERROR: *//" | tr -s " " | cut -c1-240 | sed "s/ *$//")
fi
url=$($DVC remote list 2>/dev/null | awk -v r="$remote" '$1 == r {print $2}')
echo "error: dvc pull from remote '$remote' ($url) failed: ${reason:-dvc exited $status}; check its URL, endpoint and credentials (dvc remote list), or freeze here with dvc repro freeze" >&2
exit 2
