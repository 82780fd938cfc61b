#!/usr/bin/env bash
# Single node:  launch/torchrun.sh CONFIG [NPROC] [extra train.py args]
# Multi node:   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 launch/torchrun.sh CONFIG 8   (run on every node)
set -euo pipefail
config=${1:?usage: launch/torchrun.sh CONFIG [NPROC] [train.py args...]}; shift
nproc=${1:-2}; [ $# -gt 0 ] && shift
here=$(cd "$(dirname "$0")" && pwd)
# One process checks config, machine and arguments first: a refusal is one message and exit 2, before torchrun
# starts a rank (each rank would print it, and the launcher add its own failure report).
python "$here/train.py" --check --world-size "$(( nproc * ${NNODES:-1} ))" --fp8dist-config "$config" "$@" >/dev/null
exec torchrun --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --master_addr "${MASTER_ADDR:-127.0.0.1}" \
  --master_port "${MASTER_PORT:-29500}" --nproc_per_node "$nproc" "$here/train.py" --fp8dist-config "$config" "$@"
