#!/usr/bin/env bash
# Single node:  launch/deepspeed.sh CONFIG [NUM_GPUS] [extra train.py args]
# Multi node:   HOSTFILE=launch/hostfile.example launch/deepspeed.sh CONFIG   (passwordless ssh between hosts)
set -euo pipefail
config=${1:?usage: launch/deepspeed.sh CONFIG [NUM_GPUS] [train.py args...]}; shift
gpus=${1:-2}; [ $# -gt 0 ] && shift
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "${HOSTFILE:-}" ]; then
  exec deepspeed --hostfile "$HOSTFILE" "$here/train.py" --fp8dist-config "$config" "$@"
fi
exec deepspeed --num_gpus "$gpus" "$here/train.py" --fp8dist-config "$config" "$@"
