#!/usr/bin/env bash
# Renders the chart's DaemonSet pod as a static Pod manifest, for a kubelet
# that runs it from its staticPodPath (no API server: the pod may reference
# no ConfigMap, Secret or service account):
#
#   scripts/static-pod.sh POD.json CONFIG_DIR [helm template flags...]
#
# POD.json gets the DaemonSet's spec.template as a Pod (JSON, one line);
# CONFIG_DIR/config.toml gets the chart's config.toml, and the pod mounts
# CONFIG_DIR (configHostPath) read-only at /etc/imgbridge. The flags are
# passed to `helm template` (e.g. --set containerdSocket=/run/x/containerd.sock
# --set hostNetwork=true --set image.tag=...): the pod is the chart's own,
# with nothing added. Needs helm (scripts/peers.sh fetch helm), yq and jq.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "static-pod: $*" >&2; exit 1; }

(($# >= 2)) || die "usage: $0 POD.json CONFIG_DIR [helm template flags...]"
pod_out="$1" config_dir="$2"
shift 2
[[ "$config_dir" == /* ]] || die "CONFIG_DIR must be absolute (it is a hostPath)"
helm="${HELM:-$("$repo_root/scripts/peers.sh" fetch helm | awk '{print $3}')/helm}"

rendered="$("$helm" template imgbridge "$repo_root/charts/imgbridge" --namespace kube-system \
    "$@" --set-string configHostPath="$config_dir" | yq -c 'select(. != null)')"
ds="$(jq -c 'select(.kind == "DaemonSet")' <<<"$rendered")"
[[ -n "$ds" ]] || die "the chart rendered no DaemonSet"

pod="$(jq -c '{apiVersion: "v1", kind: "Pod",
    metadata: {name: .metadata.name, namespace: .metadata.namespace,
               labels: .spec.template.metadata.labels,
               annotations: .spec.template.metadata.annotations},
    spec: .spec.template.spec}' <<<"$ds")"
# What a kubelet without an API server cannot provide.
bad="$(jq -r '.spec as $s
    | ([$s.volumes[]? | select(.configMap or .secret or .projected or .downwardAPI or .persistentVolumeClaim) | "volume \(.name)"]
       + (if $s.serviceAccountName then ["serviceAccountName"] else [] end)
       + (if $s.automountServiceAccountToken != false then ["automountServiceAccountToken"] else [] end)
       + [$s.containers[] | select(.envFrom or ([.env[]? | select(.valueFrom)] | length > 0)) | "env of \(.name)"])
    | join(", ")' <<<"$pod")"
[[ -z "$bad" ]] || die "the pod references API objects: $bad"

mkdir -p "$config_dir" "$(dirname "$pod_out")"
jq -r 'select(.kind == "ConfigMap") | .data["config.toml"]' <<<"$rendered" >"$config_dir/config.toml.tmp"
[[ -s "$config_dir/config.toml.tmp" ]] || die "the chart rendered no config.toml"
mv "$config_dir/config.toml.tmp" "$config_dir/config.toml"
# Written under a dot name first: kubelet ignores dot files, so it never
# reads half a manifest.
tmp="$(dirname "$pod_out")/.$(basename "$pod_out").tmp"
echo "$pod" >"$tmp"
mv "$tmp" "$pod_out"
