# Sourced by scripts/load.sh and scripts/bench-fleet.sh (after they define `log` and
# `root`): their release binaries, a temporary `apron serve` config with fresh tokens,
# and starting the server on it.
#
#   release_binaries EXAMPLE...            BIN_DIR as given, or builds release `apron`
#       and the server examples named (into TARGET_DIR, default <repo>/target) and sets
#       BIN_DIR; exits when a binary is missing
#   write_config DIR DATA [STORAGE_TOML]   writes DIR/apron.toml: 127.0.0.1 port 0, an
#       ingest and an SQL token (sets ingest_token and sql_token), [storage] data_dir
#       DATA plus STORAGE_TOML, [query] timeout 10m (verification queries read every row)
#   start_apron BIN CONFIG OUT NAME        starts `BIN serve --config CONFIG` (stdout
#       OUT/NAME.out, stderr OUT/NAME.err) in the background, sets server_pid and addr,
#       and waits for "listening on" and /healthz; exits the script when it cannot
#   cleanup                                 for `trap cleanup EXIT`: stops the sampler
#       (sampler_pid) and the server, removes $tmp unless KEEP_DATA=1 (uses the
#       script's `log`)

release_binaries() {
    local target=${TARGET_DIR:-$root/target} args=() e
    if [ -n "${BIN_DIR:-}" ]; then
        BIN_DIR="$(cd "$BIN_DIR" && pwd)"
    else
        for e in "$@"; do args+=(--example "$e"); done
        log "building release apron and the examples: $*"
        CARGO_TARGET_DIR="$target" cargo build --release -p apron --bin apron "${args[@]}"
        BIN_DIR="$target/release"
    fi
    for e in apron "${@/#/examples/}"; do
        [ -x "$BIN_DIR/$e" ] || { log "missing $BIN_DIR/$e"; exit 1; }
    done
}

server_pid=""
sampler_pid=""
cleanup() {
    if [ -n "$sampler_pid" ]; then kill "$sampler_pid" 2>/dev/null || true; fi
    if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; fi
    if [ "${KEEP_DATA:-0}" = 1 ]; then log "kept $tmp"; else rm -rf "$tmp"; fi
}

write_config() {
    local dir=$1 data=$2 storage_toml=${3:-}
    ingest_token=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
    sql_token=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
    cat > "$dir/apron.toml" <<TOML
[server]
listen = "127.0.0.1:0"

[ingest]
tokens = ["$ingest_token"]

[sql]
tokens = ["$sql_token"]

[storage]
data_dir = "$data"
$storage_toml

[query]
timeout = "10m"
TOML
}

start_apron() {
    local bin=$1 config=$2 out=$3 name=$4 i
    "$bin" serve --config "$config" > "$out/$name.out" 2> "$out/$name.err" &
    server_pid=$!
    addr=""
    for ((i = 0; i < 6000; i++)); do
        addr=$(sed -n 's/^listening on //p' "$out/$name.out" | head -1)
        [ -n "$addr" ] && break
        kill -0 "$server_pid" 2>/dev/null || { echo "apron serve exited; see $out/$name.err" >&2; tail -20 "$out/$name.err" >&2; exit 1; }
        sleep 0.1
    done
    [ -n "$addr" ] || { echo "apron serve did not print its address" >&2; exit 1; }
    for ((i = 0; i < 600; i++)); do
        curl -fsS -o /dev/null "http://$addr/healthz" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "http://$addr/healthz did not answer" >&2
    exit 1
}
