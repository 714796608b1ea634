# Sourced by the launch scripts (gpu_slurm.sbatch keeps its own copy: sbatch runs a
# spooled copy of the script, away from this directory).
quote_words() { # prints its arguments as one shell-quoted line, readable and copy-pasteable
  local word out=()
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
      out+=("$word")
    else
      out+=("'${word//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}
