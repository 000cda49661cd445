#!/usr/bin/env bash
# podman, runc, mmdebstrap and catatonit (the image tests build and run the CPU image), installed
# from Debian with apt-get when any is missing (as root, or through sudo). `make test` runs this.
set -euo pipefail
need=""
for tool in podman runc mmdebstrap catatonit; do
    command -v "$tool" >/dev/null || [ -x "/usr/bin/$tool" ] || [ -x "/usr/libexec/podman/$tool" ] || need=1
done
[ -z "$need" ] && exit 0
if ! command -v apt-get >/dev/null; then
    echo "error: the image tests need podman, runc, mmdebstrap and catatonit; install them (no apt-get here)" >&2
    exit 1
fi
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
start=$SECONDS
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    podman runc mmdebstrap containernetworking-plugins iptables catatonit >/dev/null
echo "installed podman, runc, mmdebstrap, catatonit in $((SECONDS - start)) s"
