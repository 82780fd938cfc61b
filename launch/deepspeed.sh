#!/usr/bin/env bash
# Single node:  launch/deepspeed.sh CONFIG [NUM_GPUS] [extra train.py args]
# Multi node:   HOSTFILE=launch/hostfile.example launch/deepspeed.sh CONFIG   (passwordless ssh between hosts)
set -euo pipefail
config=${1:?usage: launch/deepspeed.sh CONFIG [NUM_GPUS] [train.py args...]}; shift
gpus=${1:-2}; [ $# -gt 0 ] && shift
here=$(cd "$(dirname "$0")" && pwd)
# One process checks config, machine and arguments first: a refusal is one message and exit 2, before deepspeed
# starts a rank (each rank would print it, and the launcher add its own failure report).
# With a hostfile the world size is the hostfile's: the ranks check the mesh before loading any weight.
world=(); [ -z "${HOSTFILE:-}" ] && world=(--world-size "$gpus")
python "$here/train.py" --check "${world[@]}" --fp8dist-config "$config" "$@" >/dev/null
if [ -n "${HOSTFILE:-}" ]; then
  exec deepspeed --hostfile "$HOSTFILE" "$here/train.py" --fp8dist-config "$config" "$@"
fi
exec deepspeed --num_gpus "$gpus" "$here/train.py" --fp8dist-config "$config" "$@"
