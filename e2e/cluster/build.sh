#!/usr/bin/env bash
# Build the e2e control plane from the Go module proxy: kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl (Kubernetes 1.37 by default; RLJOB_KUBE_VERSION=v1.36.3 for the previous
# minor, each pinned by its own module under gomod/kubernetes-<minor>), etcd 3.6, the kwok
# controller, helm v3 and Kueue's manager (with its CRDs and webhook configurations).
# Binaries land in a cache directory outside the repo, keyed by versions, and are built only when
# missing or when what they are built from changed (their pinning module under gomod/, package or
# ldflags: a stamp beside each binary). Prints the directory holding the binaries as its last line.
set -euo pipefail

SUPPORTED_KUBE_VERSIONS=(v1.37.2 v1.36.3)
KUBE_VERSION=${RLJOB_KUBE_VERSION:-${SUPPORTED_KUBE_VERSIONS[0]}}
if [[ ! " ${SUPPORTED_KUBE_VERSIONS[*]} " =~ " $KUBE_VERSION " ]]; then
  echo "RLJOB_KUBE_VERSION=$KUBE_VERSION is not pinned here; choose one of: ${SUPPORTED_KUBE_VERSIONS[*]}" >&2
  exit 2
fi
ETCD_VERSION=v3.6.16
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0
KEDA_VERSION=v2.16.1
KUEUE_VERSION=v0.17.0

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${RLJOB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rljob}"
bin_dir="$cache_root/bin/kube-${KUBE_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_helm-${HELM_VERSION}"
mkdir -p "$bin_dir"

export CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly"
build_date="2026-01-01T00:00:00Z"

log() { printf '[cluster-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# The key of what NAME is made from: its pinning module's files (go.mod, go.sum, sources) and the
# rest of the arguments (package, ldflags). An edit under gomod/ rebuilds what it pins; Go's own
# build cache keeps such a rebuild short when little changed.
key_of() {
  local dir=$1; shift
  { (cd "$here/gomod/$dir" && find . -type f | LC_ALL=C sort | xargs sha256sum); printf '%s\n' "$@"; } \
    | sha256sum | cut -c1-16
}

# fresh NAME KEY: NAME is in the cache and was made from KEY.
fresh() { [[ -e "$bin_dir/$1" && "$(cat "$bin_dir/$1.key" 2>/dev/null)" == "$2" ]]; }

# build NAME MODULE_DIR PACKAGE LDFLAGS: go build with a heartbeat so long builds show progress.
build() {
  local name=$1 dir=$2 pkg=$3 ldflags=$4
  local key
  key="$(key_of "$dir" "$pkg" "$ldflags")"
  if fresh "$name" "$key"; then
    log "$name: cached"
    return
  fi
  [[ -e "$bin_dir/$name" ]] && log "$name: its module or build flags changed"
  log "$name: building $pkg (this is the slow part on a cold cache)"
  local start=$SECONDS
  ( while sleep 30; do log "$name: still building ($((SECONDS - start))s)"; done ) &
  local ticker=$!
  trap 'kill $ticker 2>/dev/null || true' RETURN
  (cd "$here/gomod/$dir" && go build -ldflags "-s -w $ldflags" -o "$bin_dir/$name.tmp" "$pkg")
  mv "$bin_dir/$name.tmp" "$bin_dir/$name"
  echo "$key" > "$bin_dir/$name.key"
  log "$name: built in $((SECONDS - start))s"
}

minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
kube_module="kubernetes-v1.$minor"
kube_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  kube_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

total_start=$SECONDS
build etcd etcd . ""
build kube-apiserver "$kube_module" k8s.io/kubernetes/cmd/kube-apiserver "$kube_ldflags"
build kube-controller-manager "$kube_module" k8s.io/kubernetes/cmd/kube-controller-manager "$kube_ldflags"
build kube-scheduler "$kube_module" k8s.io/kubernetes/cmd/kube-scheduler "$kube_ldflags"
build kubectl "$kube_module" k8s.io/kubernetes/cmd/kubectl "$kube_ldflags"
build kwok kwok sigs.k8s.io/kwok/cmd/kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"
helm_ldflags="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
done
build helm helm helm.sh/helm/v3/cmd/helm "$helm_ldflags"

# kwok's own fast stages (node init + heartbeat, pod ready + delete) from the pinned module. Pods
# stay Running: pod-complete is left out so tests decide when a Job's pods finish.
stages_key="$(key_of kwok stages)"
if ! fresh kwok-stages.yaml "$stages_key"; then
  kwok_dir="$(cd "$here/gomod/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
  {
    for f in node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml pod/fast/pod-ready.yaml pod/fast/pod-delete.yaml; do
      echo "---"; cat "$kwok_dir/kustomize/stage/$f"
    done
  } > "$bin_dir/kwok-stages.yaml.tmp"
  mv "$bin_dir/kwok-stages.yaml.tmp" "$bin_dir/kwok-stages.yaml"
  echo "$stages_key" > "$bin_dir/kwok-stages.yaml.key"
  log "kwok stages written"
fi
# KEDA's own CRDs (ScaledObject, TriggerAuthentication) from its pinned Go module, for the tests
# that register them so the API server validates what the operator applies to KEDA. KEDA's
# controller is not built or run: the tests check what the operator writes, not KEDA's scaling.
keda_crds="$bin_dir/keda-crds-$KEDA_VERSION.yaml"
if [[ ! -s "$keda_crds" ]]; then
  keda_dir="$(GOFLAGS=-mod=mod go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  {
    for f in keda.sh_scaledobjects.yaml keda.sh_triggerauthentications.yaml; do
      echo "---"; cat "$keda_dir/config/crd/bases/$f"
    done
  } > "$keda_crds.tmp"
  mv "$keda_crds.tmp" "$keda_crds"
  log "KEDA $KEDA_VERSION CRDs written"
fi
# Kueue's manager, and its CRDs and webhook configurations from the same module (the tests that
# submit RLJobs through Kueue run it beside the control plane: e2e/kueue.py).
# Only on the default Kubernetes version, the one the whole e2e tier runs on.
if [[ $KUBE_VERSION == "${SUPPORTED_KUBE_VERSIONS[0]}" ]]; then
  build kueue kueue sigs.k8s.io/kueue/cmd/kueue "-X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
fi
kueue_key="$(key_of kueue manifests)"
if [[ $KUBE_VERSION == "${SUPPORTED_KUBE_VERSIONS[0]}" ]] && ! fresh kueue-manifests.yaml "$kueue_key"; then
  kueue_dir="$(cd "$here/gomod/kueue" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
  {
    for f in "$kueue_dir"/config/components/crd/bases/*.yaml "$kueue_dir/config/components/webhook/manifests.yaml"; do
      echo "---"; cat "$f"
    done
  } > "$bin_dir/kueue-manifests.yaml.tmp"
  mv "$bin_dir/kueue-manifests.yaml.tmp" "$bin_dir/kueue-manifests.yaml"
  echo "$kueue_key" > "$bin_dir/kueue-manifests.yaml.key"
  log "Kueue $KUEUE_VERSION CRDs and webhooks written"
fi
log "all binaries ready in $((SECONDS - total_start))s"
echo "$bin_dir"
