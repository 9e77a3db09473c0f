#!/usr/bin/env bash
# Checks charts/imgbridge: `helm lint --strict` and `helm template` for every
# runtime preset (each must mount and configure its own containerd socket,
# and its config.toml must load in imgbridge itself), the optional objects,
# a bad preset's error, the chart's version against Cargo.toml, and that
# scripts/static-pod.sh turns the DaemonSet's pod into a static pod.
#
#   scripts/test-chart.sh [IMGBRIDGE_BINARY]
#       with a binary, each rendered config.toml goes through
#       `imgbridge serve --config ... --print-config` (the real parser).
# Needs helm (scripts/peers.sh fetch helm), yq and jq. Prints
# "N passed, 0 failed" at the end; exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-}"
chart=charts/imgbridge
passed=0
fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "ok $*"; passed=$((passed + 1)); }

helm="$(scripts/peers.sh fetch helm | awk '{print $3}')/helm"
"$helm" version --template 'helm {{.Version}}{{"\n"}}'
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# helm template → one JSON object per line.
render() { "$helm" template imgbridge "$chart" --namespace kube-system "$@" | yq -c 'select(. != null)'; }
obj() { jq -c --arg k "$1" 'select(.kind == $k)' <<<"$2"; }

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
chart_v="$(yq -r .version "$chart/Chart.yaml")" app_v="$(yq -r .appVersion "$chart/Chart.yaml")"
[[ "$chart_v" == "$version" && "$app_v" == "$version" ]] ||
    fail "Chart.yaml version $chart_v / appVersion $app_v, Cargo.toml $version"
ok "Chart.yaml version and appVersion are Cargo.toml's ($version)"

declare -A config=(
    [containerd]=/etc/containerd/config.toml
    [kind]=/etc/containerd/config.toml
    [k3s]=/var/lib/rancher/k3s/agent/etc/containerd/config.toml
    [rke2]=/var/lib/rancher/rke2/agent/etc/containerd/config.toml
    [k0s]=/etc/k0s/containerd.toml
    [microk8s]=/var/snap/microk8s/current/args/containerd.toml
)
declare -A socket=(
    [containerd]=/run/containerd/containerd.sock
    [kind]=/run/containerd/containerd.sock
    [k3s]=/run/k3s/containerd/containerd.sock
    [rke2]=/run/k3s/containerd/containerd.sock
    [k0s]=/run/k0s/containerd.sock
    [microk8s]=/var/snap/microk8s/common/run/containerd.sock
)
presets="$(yq -r '.runtimes | keys | join(" ")' "$chart/values.yaml")"
[[ "$presets" == "$(printf '%s\n' "${!socket[@]}" | sort | tr '\n' ' ' | sed 's/ $//')" ]] ||
    fail "values.yaml presets ($presets) are not the ones tested here (${!socket[*]})"

for rt in $(printf '%s\n' "${!socket[@]}" | sort); do
    sock="${socket[$rt]}"
    "$helm" lint --strict "$chart" --set runtime="$rt" >"$work/lint" 2>&1 || { cat "$work/lint"; fail "helm lint --set runtime=$rt"; }
    out="$(render --set runtime="$rt")"
    ds="$(obj DaemonSet "$out")"
    cfg="$(obj ConfigMap "$out" | jq -r '.data["config.toml"]')"
    printf '%s\n' "$cfg" >"$work/config-$rt.toml"
    up="$(grep -E '^upstream = ' "$work/config-$rt.toml" | cut -d'"' -f2)"
    [[ "$up" == "$sock" ]] || fail "$rt: config upstream '$up', expected $sock"
    cfgf="${config[$rt]}"
    jq -e --arg d "${sock%/*}" --arg cd "${cfgf%/*}" --arg cf "$cfgf" '
        .spec.template.spec as $s
        | ($s.volumes[] | select(.name == "containerd") | .hostPath.path == $d and .hostPath.type == "Directory")
          and ($s.containers[0].volumeMounts[] | select(.name == "containerd")
               | .mountPath == $d and .readOnly == true and .mountPropagation == "HostToContainer")
          and ($s.volumes[] | select(.name == "containerd-config") | .hostPath.path == $cd)
          and ($s.containers[0].volumeMounts[] | select(.name == "containerd-config") | .mountPath == $cd and .readOnly == true)
          and ([$s.containers[0].env[] | select(.name == "IMGBRIDGE_CONTAINERD_CONFIG") | .value] == [$cf])
          and ($s.containers[0].imagePullPolicy == "Never")
          and ($s.nodeSelector["kubernetes.io/os"] == "linux")
          and ($s.containers[0].image == "imgbridge:'"$version"'")
          and ($s.containers[0].securityContext.runAsUser == 0)
          and ($s.containers[0].securityContext.privileged == false)' <<<"$ds" >/dev/null ||
        fail "$rt: DaemonSet does not mount ${sock%/*} read-only (HostToContainer) and ${cfgf%/*} at the same paths, or image/pull policy/os selector/securityContext wrong: $ds"
    if [[ -n "$bin" ]]; then
        printed="$("$bin" serve --config "$work/config-$rt.toml" --print-config)" ||
            fail "$rt: imgbridge rejects the rendered config.toml"
        grep -qxF "upstream = \"$sock\"" <<<"$printed" || fail "$rt: imgbridge reads upstream as: $(grep upstream <<<"$printed")"
    fi
    ok "runtime=$rt: lint, template, socket dir ${sock%/*} (read-only), containerd config $cfgf${bin:+, config loads in imgbridge}"
done

zero_digest="sha256:$(printf '%064d' 0)"

# Everything optional on, and values the chart passes into config.toml.
all=(--set runtime=k3s --set metrics.serviceMonitor.enabled=true --set metrics.dashboard.enabled=true
    --set 'importDirs[0].path=/var/lib/imgbridge/images' --set 'importDirs[1].path=/srv/images'
    --set 'importDirs[1].namespace=buildkit' --set socket.group=docker --set metrics.port=9555
    --set-json 'replication.sourceNamespaces=["default","buildkit"]' --set config.replication.pin=true
    --set config.import.pull_attempts=7 --set config.drain_timeout=20s --set image.digest=$zero_digest
    --set priorityClassName=custom --set hostNetwork=true)
"$helm" lint --strict "$chart" "${all[@]}" >"$work/lint" 2>&1 || { cat "$work/lint"; fail "helm lint with every option"; }
out="$(render "${all[@]}")"
for kind in ConfigMap DaemonSet Service ServiceMonitor; do
    [[ -n "$(obj "$kind" "$out")" ]] || fail "no $kind rendered with every option"
done
obj ConfigMap "$out" | jq -r 'select(.metadata.name | endswith("-dashboard")) | .data["imgbridge.json"]' |
    jq -e '.panels | length > 0' >/dev/null || fail "dashboard ConfigMap holds no dashboard JSON"
ds="$(obj DaemonSet "$out")"
jq -e '.spec.template.spec as $s
    | $s.hostNetwork == true and $s.priorityClassName == "custom"
      and $s.containers[0].image == "imgbridge@'"$zero_digest"'"
      and ($s.containers[0].ports == null)
      and $s.containers[0].readinessProbe.httpGet.port == 9555
      and ([$s.volumes[] | select(.hostPath.path == "/etc/group")] | length == 1)
      and ([$s.volumes[] | select(.hostPath.path == "/srv/images" and .hostPath.type == "DirectoryOrCreate")] | length == 1)
      and ([$s.containers[0].volumeMounts[] | select(.mountPath == "/srv/images")] | length == 1)' <<<"$ds" >/dev/null ||
    fail "every option: DaemonSet lacks hostNetwork/priority/digest/port/group file/import dir: $ds"
obj ConfigMap "$out" | jq -r 'select(.metadata.name | endswith("-dashboard") | not) | .data["config.toml"]' >"$work/all.toml"
for want in 'pin = true' 'pull_attempts = 7' 'drain_timeout = "20s"' 'socket_group = "docker"' \
    'listen = "127.0.0.1:9555"' 'source_namespaces = ["default","buildkit"]' \
    '  { path = "/srv/images", namespace = "buildkit" },'; do
    grep -qxF "$want" "$work/all.toml" || fail "every option: config.toml lacks '$want':"$'\n'"$(cat "$work/all.toml")"
done
if [[ -n "$bin" ]]; then
    "$bin" serve --config "$work/all.toml" --print-config >"$work/all.printed" || fail "imgbridge rejects the config.toml of every option"
    grep -qxF 'namespace = "buildkit"' "$work/all.printed" || fail "imgbridge lost an import dir's namespace"
fi
ok "every option: ServiceMonitor, dashboard, import dirs, group file, extra config keys${bin:+ (config loads)}"

# The drain: the grace period less 5 s unless config.drain_timeout is set
# (an upgrade's old pod lets a build's write in flight finish).
out="$(render)"
obj ConfigMap "$out" | jq -r '.data["config.toml"] // empty' | grep -qxF 'drain_timeout = "55s"' ||
    fail "default: config.toml lacks drain_timeout = \"55s\""
[[ "$(obj DaemonSet "$out" | jq -r '.spec.template.spec.terminationGracePeriodSeconds')" == 60 ]] ||
    fail "default: terminationGracePeriodSeconds is not 60"
out="$(render --set terminationGracePeriodSeconds=3)"
obj ConfigMap "$out" | jq -r '.data["config.toml"] // empty' | grep -qxF 'drain_timeout = "1s"' ||
    fail "grace 3 s: drain_timeout is not 1s"
ok "drain_timeout follows terminationGracePeriodSeconds (55s of 60 s; a config.drain_timeout wins)"

# The registry endpoint: [registry] on the node's loopback, the KEP-1755
# ConfigMap, and a clear error without hostNetwork.
reg=(--set registry.enabled=true --set registry.port=5123 --set hostNetwork=true)
"$helm" lint --strict "$chart" "${reg[@]}" >"$work/lint" 2>&1 || { cat "$work/lint"; fail "helm lint with the registry on"; }
out="$(render "${reg[@]}")"
obj ConfigMap "$out" | jq -r 'select(.metadata.name == "local-registry-hosting") | .data["localRegistryHosting.v1"]' >"$work/lrh"
[[ "$(obj ConfigMap "$out" | jq -r 'select(.metadata.name == "local-registry-hosting") | .metadata.namespace')" == kube-public ]] ||
    fail "registry: no local-registry-hosting ConfigMap in kube-public"
[[ "$(yq -r .host "$work/lrh")" == localhost:5123 && "$(yq -r .hostFromContainerRuntime "$work/lrh")" == localhost:5123 ]] ||
    fail "registry: local-registry-hosting says: $(cat "$work/lrh")"
obj ConfigMap "$out" | jq -r 'select(.data["config.toml"]) | .data["config.toml"]' >"$work/reg.toml"
grep -qxF 'listen = "127.0.0.1:5123"' "$work/reg.toml" || fail "registry: config.toml lacks its listen:"$'\n'"$(cat "$work/reg.toml")"
if [[ -n "$bin" ]]; then
    "$bin" serve --config "$work/reg.toml" --print-config >"$work/reg.printed" || fail "imgbridge rejects the registry's config.toml"
    grep -qxF 'listen = "127.0.0.1:5123"' "$work/reg.printed" || fail "imgbridge lost [registry] listen"
fi
[[ "$(render --set registry.enabled=true --set registry.localRegistryHosting.host=node1:5123 --set hostNetwork=true |
    jq -r 'select(.metadata.name == "local-registry-hosting") | .data["localRegistryHosting.v1"]' | yq -r .host)" == node1:5123 ]] ||
    fail "registry: localRegistryHosting.host is not published"
[[ -z "$(render | jq -c 'select(.metadata.name == "local-registry-hosting")')" ]] || fail "local-registry-hosting rendered with the registry off"
grep -qxF '[registry]' <(render | jq -r 'select(.data["config.toml"]) | .data["config.toml"]') && fail "[registry] rendered with the registry off"
if "$helm" template imgbridge "$chart" --set registry.enabled=true >"$work/bad" 2>&1; then
    fail "registry.enabled without hostNetwork rendered"
fi
grep -q 'registry.enabled needs hostNetwork: true' "$work/bad" || fail "registry without hostNetwork: $(cat "$work/bad")"
ok "registry: [registry] on the node's loopback, KEP-1755 local-registry-hosting, needs hostNetwork${bin:+ (config loads)}"

# The image: side-loaded by default (Never: no node asks Docker Hub for
# docker.io/library/imgbridge), pulled when it names a registry or a digest.
policy() { render "$@" | jq -r 'select(.kind == "DaemonSet") | .spec.template.spec.containers[0].imagePullPolicy'; }
[[ "$(policy)" == Never ]] || fail "default image pull policy: $(policy)"
[[ "$(policy --set image.repository=registry.example/imgbridge)" == IfNotPresent ]] || fail "a registry's image is not pulled"
[[ "$(policy --set image.digest="$zero_digest")" == IfNotPresent ]] || fail "a digest-pinned image is not pulled"
[[ "$(policy --set image.pullPolicy=Always)" == Always ]] || fail "image.pullPolicy is not honoured"
"$helm" install --dry-run=client imgbridge "$chart" >"$work/notes" 2>&1 || fail "helm install --dry-run: $(cat "$work/notes")"
grep -q 'side-loaded (imagePullPolicy: Never)' "$work/notes" || fail "NOTES.txt does not say the image is side-loaded: $(cat "$work/notes")"
[[ "$(render | jq -r 'select(.kind == "Pod") | .spec.containers[0].imagePullPolicy')" == Never ]] || fail "the helm test pod's pull policy differs"
ok "image: side-loaded name never pulled (NOTES.txt says so), a registry's or a digest IfNotPresent"

# /metrics: every address family on the pod's network; the node's loopback
# only with hostNetwork (probed there); metrics.listen overrides.
cfg_of() { render "$@" | jq -r 'select(.data["config.toml"]) | .data["config.toml"]'; }
probe_host() { render "$@" | jq -r 'select(.kind == "DaemonSet") | .spec.template.spec.containers[0] | [.livenessProbe.httpGet.host, .readinessProbe.httpGet.host] | map(. // "-") | join(" ")'; }
grep -qxF 'listen = "[::]:9464"' <(cfg_of) || fail "metrics on the pod network: $(cfg_of | grep listen)"
[[ "$(probe_host)" == "- -" ]] || fail "probes on the pod network name a host: $(probe_host)"
grep -qxF 'listen = "127.0.0.1:9464"' <(cfg_of --set hostNetwork=true) || fail "metrics with hostNetwork: $(cfg_of --set hostNetwork=true | grep listen)"
[[ "$(probe_host --set hostNetwork=true)" == "127.0.0.1 127.0.0.1" ]] || fail "probes with hostNetwork: $(probe_host --set hostNetwork=true)"
grep -qxF 'listen = "[::]:9464"' <(cfg_of --set hostNetwork=true --set-string 'metrics.listen=[::]:9464') || fail "metrics.listen is not honoured"
[[ "$(probe_host --set hostNetwork=true --set-string 'metrics.listen=[::]:9464')" == "- -" ]] || fail "probes of an exposed listen name a host"
ok "metrics: [::] on the pod network, the node's loopback with hostNetwork (probed there), metrics.listen"

# securityContext merged over the container's own (SELinux), the pod's
# securityContext, extra env, volumes and mounts; the test pod gets them too.
out="$(render --set-string securityContext.seLinuxOptions.type=spc_t --set podSecurityContext.fsGroup=1234 \
    --set 'extraEnv[0].name=FOO' --set 'extraEnv[0].value=bar' --set 'extraVolumes[0].name=x' \
    --set 'extraVolumes[0].emptyDir.medium=Memory' --set 'extraVolumeMounts[0].name=x' --set 'extraVolumeMounts[0].mountPath=/x')"
for kind in DaemonSet Pod; do
    obj "$kind" "$out" | jq -e '(.spec.template.spec // .spec) as $s | $s.containers[0] as $c
        | $c.securityContext.seLinuxOptions.type == "spc_t" and $c.securityContext.readOnlyRootFilesystem == true
          and $c.securityContext.capabilities.drop == ["ALL"] and $s.securityContext.fsGroup == 1234
          and ([$c.env[] | select(.name == "FOO" and .value == "bar")] | length == 1)
          and ([$c.env[] | select(.name == "IMGBRIDGE_CONTAINERD_CONFIG")] | length == 1)
          and ([$s.volumes[] | select(.name == "x" and .emptyDir.medium == "Memory")] | length == 1)
          and ([$c.volumeMounts[] | select(.name == "x" and .mountPath == "/x")] | length == 1)' >/dev/null ||
        fail "$kind: securityContext/podSecurityContext/extraEnv/extraVolumes not rendered: $(obj "$kind" "$out")"
done
[[ "$(render --set-string containerdConfig=- | jq -c 'select(.kind == "DaemonSet") | [.spec.template.spec.volumes[] | select(.name == "containerd-config")]')" == "[]" ]] ||
    fail "containerdConfig=- still mounts containerd's config"
ok "securityContext (seLinuxOptions) merged over the defaults, podSecurityContext, extraEnv/Volumes/Mounts, containerdConfig=-"

# Upgrades: the surge pod takes the socket over; on the node's network no
# container ports (host ports a surge pod could not share).
ds="$(render | jq -c 'select(.kind == "DaemonSet")')"
jq -e '.spec.updateStrategy.rollingUpdate == {maxSurge: 1, maxUnavailable: 0}
    and .spec.template.spec.containers[0].ports[0].containerPort == 9464' <<<"$ds" >/dev/null ||
    fail "upgrade strategy / pod-network ports: $ds"
grep -qxF 'socket_handover = true' <(cfg_of) || fail "config.toml lacks socket_handover = true"
[[ "$(render --set hostNetwork=true | jq -c 'select(.kind == "DaemonSet") | .spec.template.spec.containers[0].ports')" == null ]] ||
    fail "host-network pod declares ports (host ports)"
ok "upgrades: maxSurge 1 / maxUnavailable 0 with socket_handover; no host ports on the node's network"

# The helm test pod is not the DaemonSet's: its controller would adopt and
# delete a pod matching its selector.
sel="$(render | jq -c 'select(.kind == "DaemonSet") | .spec.selector.matchLabels')"
render | jq -e --argjson sel "$sel" 'select(.kind == "Pod") | .metadata.labels as $l | [$sel | to_entries[] | $l[.key] == .value] | all | not' >/dev/null ||
    fail "the helm test pod carries the DaemonSet's selector labels ($sel)"
ok "the helm test pod does not match the DaemonSet's selector"

# values.schema.json: an unquoted octal mode (YAML reads 0660 as 432), an
# unknown key, a bad enum.
printf 'socket:\n  mode: 0660\n' >"$work/octal.yaml"
"$helm" template imgbridge "$chart" -f "$work/octal.yaml" >"$work/bad" 2>&1 && fail "socket.mode: 0660 (unquoted) rendered"
grep -q "/socket/mode': got number, want string" "$work/bad" || fail "unquoted mode: $(cat "$work/bad")"
"$helm" template imgbridge "$chart" --set hostGroupFile=true >"$work/bad" 2>&1 && fail "an unknown value rendered"
grep -q "additional properties 'hostGroupFile' not allowed" "$work/bad" || fail "unknown value: $(cat "$work/bad")"
"$helm" template imgbridge "$chart" --set image.pullPolicy=Sometimes >"$work/bad" 2>&1 && fail "a bad pull policy rendered"
ok "values.schema.json refuses an unquoted octal mode, unknown keys and bad enums"

# KEP-1755: published where its host is true; kind's nodes are containers,
# so only with a host; the host is among the endpoint's names; a help URL.
lrh() { render --set registry.enabled=true --set hostNetwork=true "$@" | jq -r 'select(.metadata.name == "local-registry-hosting") | .data["localRegistryHosting.v1"]'; }
[[ -z "$(lrh --set runtime=kind)" ]] || fail "local-registry-hosting published for kind without a host"
[[ -z "$(lrh --set registry.localRegistryHosting.enabled=false)" ]] || fail "local-registry-hosting published when disabled"
[[ -n "$(lrh --set runtime=kind --set registry.localRegistryHosting.enabled=true)" ]] || fail "enabled=true does not publish"
lrh --set runtime=kind --set registry.localRegistryHosting.host=kind-registry:5000 >"$work/lrh-kind"
[[ "$(yq -r .host "$work/lrh-kind")" == kind-registry:5000 && "$(yq -r .help "$work/lrh-kind")" == https://* ]] ||
    fail "kind with a host: $(cat "$work/lrh-kind")"
grep -qxF 'hosts = ["kind-registry"]' <(cfg_of --set registry.enabled=true --set hostNetwork=true --set registry.localRegistryHosting.host=kind-registry:5000) ||
    fail "the published host is not among the endpoint's names"
grep -q '^hosts = ' <(cfg_of --set registry.enabled=true --set hostNetwork=true --set registry.localRegistryHosting.host=localhost:5001) &&
    fail "localhost added to registry.hosts"
ok "KEP-1755: not for kind unless a host is set, a help URL, the host accepted by the endpoint"

# The DaemonSet of the default values restarts on a config change only.
a="$(render | jq -r 'select(.kind == "DaemonSet") | .spec.template.metadata.annotations["checksum/config"]')"
b="$(render --set config.replication.pin=true | jq -r 'select(.kind == "DaemonSet") | .spec.template.metadata.annotations["checksum/config"]')"
[[ -n "$a" && "$a" != "$b" ]] || fail "checksum/config does not follow the config ($a, $b)"
ok "checksum/config changes with the config"

if "$helm" template imgbridge "$chart" --set runtime=docker >"$work/bad" 2>&1; then
    fail "runtime=docker rendered"
fi
grep -q 'runtime "docker": no such preset (one of: containerd, k0s, k3s, kind, microk8s, rke2)' "$work/bad" ||
    fail "runtime=docker error does not name the presets: $(cat "$work/bad")"
ok "an unknown runtime fails, naming the presets"

# The pod as a static pod: no API object referenced, config from the host.
HELM="$helm" scripts/static-pod.sh "$work/manifests/imgbridge.json" "$work/etc-imgbridge" \
    --set containerdSocket=/tmp/test-containerd/containerd.sock --set hostNetwork=true
jq -e --arg d "$work/etc-imgbridge" '.kind == "Pod" and .spec.hostNetwork == true
    and ([.spec.volumes[] | select(.name == "config") | .hostPath.path == $d] == [true])
    and ([.spec.volumes[] | select(.name == "containerd") | .hostPath.path] == ["/tmp/test-containerd"])
    and (.spec.automountServiceAccountToken == false)' "$work/manifests/imgbridge.json" >/dev/null ||
    fail "static pod: $(cat "$work/manifests/imgbridge.json")"
grep -qxF 'upstream = "/tmp/test-containerd/containerd.sock"' "$work/etc-imgbridge/config.toml" ||
    fail "static pod config: $(cat "$work/etc-imgbridge/config.toml")"
# The pod is the DaemonSet's, unchanged.
cmp <(jq -cS .spec "$work/manifests/imgbridge.json") \
    <(render --set containerdSocket=/tmp/test-containerd/containerd.sock --set hostNetwork=true \
        --set-string configHostPath="$work/etc-imgbridge" | jq -cS 'select(.kind == "DaemonSet") | .spec.template.spec') ||
    fail "static pod spec differs from the DaemonSet's pod template"
ok "scripts/static-pod.sh: the DaemonSet's pod as a static pod, config.toml in its host dir"

HELM="$helm" scripts/render-manifest.sh "$work/daemonset.yaml"
diff -u packaging/kubernetes/daemonset.yaml "$work/daemonset.yaml" ||
    fail "packaging/kubernetes/daemonset.yaml is not the chart's rendering: run scripts/render-manifest.sh"
ok "packaging/kubernetes/daemonset.yaml is the chart's rendering"

echo "chart: $passed passed, 0 failed"
