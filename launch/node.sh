#!/usr/bin/env bash
# Run this same command on every node of the job (2..N nodes); a node that restarts re-joins by running it again.
#   ETCD=etcd1:2379,etcd2:2379,etcd3:2379 RUN_ID=job-42 launch/node.sh configs/tiny-cpu.yaml
# Environment: ETCD (etcd v3 endpoints, required for multi-node), RUN_ID, NNODES (MIN:MAX), NPROC (per node).
# SIGTERM to this script drains the node (its workers save the step, it leaves, the others re-form): `exec` makes
# the agent this very process, so a process manager's stop signal reaches it rather than a shell that dies of it.
set -euo pipefail
CONFIG=${1:?usage: launch/node.sh CONFIG [--set section.field=value ...]}
shift
exec elastictrain run --config "$CONFIG" \
  --nnodes "${NNODES:-1:4}" --nproc-per-node "${NPROC:-1}" \
  --rdzv-endpoint "${ETCD:?set ETCD to the etcd endpoints, host:port[,host:port...]}" \
  --rdzv-id "${RUN_ID:?set RUN_ID, the same on every node of the job}" \
  "$@"
