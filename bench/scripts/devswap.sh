#!/usr/bin/env bash
# devswap.sh DIR FILE FROM TO [LINE EXPECT] (the release binary, or $WEIR): weir dev in DIR; once it is up,
# replace FROM with TO in FILE and time the save until "weir dev: swapped" (or, with live sources, until
# "saved; the next message runs it": nothing is built or swapped). With LINE and EXPECT: then type LINE (a
# message) and time the save until the log shows EXPECT (what the changed handler prints for it).
set -u
weir=${WEIR:-$(cd "$(dirname "$0")/../.." && pwd)/target/release/weir}
dir=$1; file=$2; from=$3; to=$4; line=${5:-}; expect=${6:-}
cd "$dir"
log=$(mktemp)
mkfifo /tmp/devswap.in.$$ 
( sleep 600 > /tmp/devswap.in.$$ ) &
holder=$!
"$weir" dev < /tmp/devswap.in.$$ > "$log" 2>&1 &
pid=$!
until grep -q "publish  type a line" "$log"; do sleep 0.2; done
sleep 1
start=$(date +%s.%N)
sed -i "s/$from/$to/" "$file"
until grep -q "weir dev: swapped\|not swapped\|nothing to swap\|weir dev: saved;" "$log"; do sleep 0.05; done
end=$(date +%s.%N)
echo "save -> $(grep -o "weir dev: swapped\|not swapped.*\|nothing to swap\|weir dev: saved;" "$log" | head -1): $(echo "$end - $start" | bc) s"
if [ -n "$line" ]; then
  echo "$line" > /tmp/devswap.in.$$
  until grep -qF "$expect" "$log"; do sleep 0.02; done
  ran=$(date +%s.%N)
  echo "save -> the next message printed \"$expect\": $(echo "$ran - $start" | bc) s"
fi
grep -o "compiled upload.*" "$log" | head -2
kill -TERM $pid 2>/dev/null; kill $holder 2>/dev/null; wait $pid 2>/dev/null
rm -f /tmp/devswap.in.$$ "$log"
