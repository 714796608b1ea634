#!/usr/bin/env bash
# Runs one command on every worker of a Cloud TPU VM or TPU slice through `gcloud ... ssh
# --worker=all`. JAX reads the slice topology from the TPU metadata server itself, so the only
# thing set here is JAXRL_DISTRIBUTED=auto, which tells jaxrl_llm.distributed.initialize() to
# call jax.distributed.initialize() and let JAX detect the rest.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_vm.sh [--dry-run] --tpu NAME --zone ZONE [--project P] [--workdir DIR]
                        -- COMMAND...

Runs COMMAND on all workers of the TPU VM / slice NAME, as
  gcloud compute tpus tpu-vm ssh NAME --zone ZONE [--project P] --worker=all \
    --command "export JAXRL_DISTRIBUTED=auto; cd DIR && COMMAND"
COMMAND's words are joined with spaces and parsed by the workers' shell (like ssh), so
`-- 'source .venv/bin/activate && python -m jaxrl_llm.train ...'` works. The repository must
already be at DIR on every worker (default: the path of this checkout here).

  --tpu NAME      TPU VM or slice name
  --zone ZONE     its zone, e.g. us-central2-b
  --project P     GCP project (default: gcloud's configured one)
  --workdir DIR   repository path on the workers (default: this repository's path here)
  --dry-run       print the gcloud command line, run nothing
  -h, --help      this help

Example:
  launch/tpu_vm.sh --tpu my-v4-32 --zone us-central2-b -- \
    python3 -m jaxrl_llm.train --config configs/quickstart.py
EOF
}

die() {
  echo "tpu_vm.sh: $*" >&2
  exit 2
}

# shellcheck source=launch/_quote.sh
source "$(dirname "${BASH_SOURCE[0]}")/_quote.sh"  # quote_words

dry_run=0
tpu=""
zone=""
project=""
workdir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
    --tpu | --zone | --project | --workdir)
      (($# >= 2)) && [[ -n $2 ]] || die "$1 needs a value"
      case "$1" in
        --tpu) tpu=$2 ;;
        --zone) zone=$2 ;;
        --project) project=$2 ;;
        --workdir) workdir=$2 ;;
      esac
      shift 2
      ;;
    --) shift; break ;;
    *) die "unexpected argument '$1' before '--' (see --help)" ;;
  esac
done
[[ -n $tpu ]] || die "--tpu NAME is required"
[[ -n $zone ]] || die "--zone ZONE is required"
(($#)) || die "no COMMAND given after '--'"

remote="export JAXRL_DISTRIBUTED=auto; cd $(printf '%q' "$workdir") && $*"
cmd=(gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone")
if [[ -n $project ]]; then
  cmd+=(--project "$project")
fi
cmd+=(--worker=all --command "$remote")

if ((dry_run)); then
  quote_words "${cmd[@]}"
  exit 0
fi
command -v gcloud >/dev/null || {
  echo "tpu_vm.sh: gcloud not found on PATH" >&2
  exit 127
}
exec "${cmd[@]}"
