#!/usr/bin/env bash
# Simulates a multi-host JAX run on one machine: NUM_PROCESSES local CPU processes, each with
# DEVICES_PER_PROCESS fake host devices, wired together through jax.distributed (gloo
# collectives). The program must call jaxrl_llm.distributed.initialize() before using JAX.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/local_multihost.sh [--dry-run] NUM_PROCESSES DEVICES_PER_PROCESS COMMAND...

Runs COMMAND in NUM_PROCESSES local processes that form one multi-process JAX run on CPU.
Process I gets:
  XLA_FLAGS="$XLA_FLAGS --xla_force_host_platform_device_count=DEVICES_PER_PROCESS"
  JAX_PLATFORMS=cpu
  JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT   (PORT: $JAXRL_PORT, else a free port)
  JAX_NUM_PROCESSES=NUM_PROCESSES
  JAX_PROCESS_ID=I
Process 0's stdout/stderr pass through unchanged; process I>0's both go to stderr, each line
prefixed with "[pI] ". Waits for all; when one fails the others are terminated and the exit
status is the first non-zero one. SIGTERM/SIGINT are forwarded to every process.

  --dry-run   print one line per process (its environment and command), run nothing
  -h, --help  this help

Example:
  launch/local_multihost.sh 2 4 python -m jaxrl_llm.train --config configs/quickstart.py
EOF
}

die() {
  echo "local_multihost.sh: $*" >&2
  exit 2
}

# shellcheck source=launch/_quote.sh
source "$(dirname "${BASH_SOURCE[0]}")/_quote.sh"  # quote_words

dry_run=0
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) break ;;
  esac
done
(($# >= 3)) || die "expected NUM_PROCESSES DEVICES_PER_PROCESS COMMAND..., got $# argument(s)"
num_processes=$1
devices=$2
shift 2
[[ $num_processes =~ ^[1-9][0-9]*$ ]] ||
  die "NUM_PROCESSES must be a positive integer, got '$num_processes'"
[[ $devices =~ ^[1-9][0-9]*$ ]] ||
  die "DEVICES_PER_PROCESS must be a positive integer, got '$devices'"

if [[ -n ${JAXRL_PORT:-} ]]; then
  [[ $JAXRL_PORT =~ ^[1-9][0-9]*$ ]] && ((JAXRL_PORT < 65536)) ||
    die "JAXRL_PORT must be a port number in 1..65535, got '$JAXRL_PORT'"
  port=$JAXRL_PORT
else
  # Bind port 0 on all interfaces (the coordinator binds [::]:PORT) and let the kernel choose.
  # The port is released before process 0 binds it again: a tiny race, hence JAXRL_PORT.
  pick_port='import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
  port=$(python3 -c "$pick_port") || die "could not pick a free port with python3; set JAXRL_PORT"
fi

xla_flags="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$devices"
process_env() { # the environment of process $1, as NAME=VALUE words
  env_words=(
    "XLA_FLAGS=$xla_flags"
    "JAX_PLATFORMS=cpu"
    "JAX_COORDINATOR_ADDRESS=127.0.0.1:$port"
    "JAX_NUM_PROCESSES=$num_processes"
    "JAX_PROCESS_ID=$1"
  )
}

if ((dry_run)); then
  for ((i = 0; i < num_processes; i++)); do
    process_env "$i"
    quote_words env "${env_words[@]}" "$@"
  done
  exit 0
fi

prefix_lines() { # copies stdin to stderr with "[p$1] " in front of every line
  # Ignore the signals sent to the process group so the last lines still get through.
  trap '' INT TERM
  local line
  while IFS= read -r line || [[ -n $line ]]; do
    printf '[p%s] %s\n' "$1" "$line" >&2
  done
}

# Job control puts every process in its own process group: background jobs then keep the
# default SIGINT disposition (without it bash starts them with SIGINT ignored), and a signal
# reaches the whole group, including anything COMMAND itself starts.
set -m
pids=()
for ((i = 0; i < num_processes; i++)); do
  process_env "$i"
  if ((i == 0)); then
    env "${env_words[@]}" "$@" &
  else
    env "${env_words[@]}" "$@" > >(prefix_lines "$i") 2>&1 &
  fi
  pids+=($!)
done

signal_all() {
  local pid
  for pid in "${pids[@]}"; do
    kill -"$1" -- -"$pid" 2>/dev/null || true
  done
}
signalled=0
trap 'signalled=1; signal_all TERM' TERM
trap 'signalled=1; signal_all INT' INT

grace=${JAXRL_KILL_GRACE:-5}
[[ $grace =~ ^[0-9]+([.][0-9]+)?$ ]] ||
  die "JAXRL_KILL_GRACE must be a number of seconds, got '$grace'"
killer=""
status=0
live=("${pids[@]}")

process_ended() { # process with pid $1 ended with status $2; the first failure stops the rest
  local pid i still=()
  for pid in "${live[@]}"; do
    if [[ $pid != "$1" ]]; then
      still+=("$pid")
    fi
  done
  live=("${still[@]}")
  if (($2 == 0 || status != 0)); then
    return
  fi
  status=$2
  if ((${#live[@]} == 0)); then
    return
  fi
  for i in "${!pids[@]}"; do
    if ((!signalled)) && [[ ${pids[$i]} == "$1" ]]; then
      echo "local_multihost.sh: process $i exited with status $2; stopping the others" >&2
    fi
  done
  signal_all TERM
  # JAX turns SIGTERM into a preemption notice rather than exiting, and a process stuck in a
  # collective with a dead peer never returns: SIGKILL whatever is left after a grace period.
  (sleep "$grace" && signal_all KILL) &
  killer=$!
}

while ((${#live[@]})); do
  finished=""
  rc=0
  wait -n -p finished "${live[@]}" 2>/dev/null || rc=$?
  if [[ -n ${finished:-} ]]; then
    process_ended "$finished" "$rc"
    continue
  fi
  # wait was interrupted by a forwarded signal, or bash had already reaped a process (it drops
  # the jobs it reported as killed from its job table): plain wait still knows their status.
  for pid in "${live[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      rc=0
      wait "$pid" 2>/dev/null || rc=$?
      process_ended "$pid" "$rc"
    fi
  done
done
if [[ -n $killer ]]; then
  kill -- -"$killer" 2>/dev/null || true
fi
exit "$status"
