#!/usr/bin/env bash
# Debian packages the driver plugins need at run time. Installs them when run as
# root; otherwise prints the command to run and carries on.
set -euo pipefail
packages=(libibverbs1 librdmacm1 libnuma1 libcurl4)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "sysdeps: not a Debian system; install ${missing[*]} (RDMA user-space libraries) yourself" >&2
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "sysdeps: run: sudo apt-get install -y ${missing[*]}" >&2
fi
