#!/usr/bin/env bash
# compile-swap.sh WEIR V1 V2 PORT: start a node on V1 (fresh data_dir, no compiled-code cache),
# then deploy V2 to it; print the node's compile lines and the deploy's wall time.
set -u
weir=$1; v1=$2; v2=$3; port=$4
dir=$(mktemp -d)
cp "$v1" "$dir/h.wasm"
cat > "$dir/n.toml" <<TOML
[node]
name = "m"
admin = "127.0.0.1:$port"
admin_token = "measure-token-0123456789"
data_dir = "$dir/data"
max_component_size = "64MiB"
[transport]
kind = "memory"
[[topology]]
name = "t"
slots = 1
[[handler]]
name = "h"
component = "$dir/h.wasm"
topology = "t"
message_types = ["greeting"]
TOML
"$weir" run --config "$dir/n.toml" > "$dir/log" 2>&1 &
pid=$!
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 0.2; done
start=$(date +%s.%N)
"$weir" deploy --admin "http://127.0.0.1:$port" --token measure-token-0123456789 --handler h "$v2" 2>&1 | tail -1
end=$(date +%s.%N)
echo "deploy wall: $(echo "$end - $start" | bc) s"
grep -o "compiled .* found compiled already)" "$dir/log"
kill -TERM $pid; wait $pid 2>/dev/null
rm -rf "$dir"
