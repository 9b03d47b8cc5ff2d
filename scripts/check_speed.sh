#!/usr/bin/env bash
# Time and peak memory of `parity check` with every backend and op by op on one model, against
# the goal in issue 10 (1.1B Q4_0 model, 2 threads: within 30 s, peak RSS < 2x the file).
# Runs it N times (default 3) and prints each run, then the median and range.
#
# Usage: scripts/check_speed.sh MODEL GOLDEN [N]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
P=${PARITY:-$root/target/release/parity}
model=$1; golden=$2; n=${3:-3}
size=$(stat -c %s "$model")
ts=(); rs=()
for i in $(seq "$n"); do
  /usr/bin/time -f "%e %M" -o /tmp/parity_speed.$$ "$P" check "$model" --golden "$golden" --threads 2 --quiet >/dev/null 2>&1 || true
  read -r t kib < /tmp/parity_speed.$$
  ratio=$(python3 -c "print(f'{$kib*1024/$size:.2f}')")
  echo "run $i: ${t} s, peak RSS $((kib / 1024)) MiB = ${ratio}x the file ($((size / 1048576)) MiB)"
  ts+=("$t"); rs+=("$ratio")
done
rm -f /tmp/parity_speed.$$
python3 - "${ts[@]}" -- "${rs[@]}" <<'PY'
import statistics, sys
a = sys.argv[1:]; i = a.index("--")
t = [float(x) for x in a[:i]]; r = [float(x) for x in a[i+1:]]
print(f"median {statistics.median(t):.1f} s (range {min(t):.1f}-{max(t):.1f}); peak RSS median {statistics.median(r):.2f}x the file (range {min(r):.2f}-{max(r):.2f}); load average {open('/proc/loadavg').read().split()[0]}")
PY
