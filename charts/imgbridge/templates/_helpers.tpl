{{/* Name of every object: the release name, or "imgbridge" inside it. */}}
{{- define "imgbridge.fullname" -}}
{{- if contains "imgbridge" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-imgbridge" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "imgbridge.selectorLabels" -}}
app.kubernetes.io/name: imgbridge
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "imgbridge.labels" -}}
{{ include "imgbridge.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "imgbridge.image" -}}
{{- if .Values.image.digest -}}
{{- if contains "@" .Values.image.digest -}}
{{- .Values.image.digest -}}
{{- else -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- end -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/*
The pull policy: image.pullPolicy, else Never for the side-loaded default
name (kubelet must never ask Docker Hub for docker.io/library/imgbridge),
else IfNotPresent.
*/}}
{{- define "imgbridge.pullPolicy" -}}
{{- if .Values.image.pullPolicy -}}
{{- .Values.image.pullPolicy -}}
{{- else if and (eq .Values.image.repository "imgbridge") (not .Values.image.digest) -}}
Never
{{- else -}}
IfNotPresent
{{- end -}}
{{- end -}}

{{/* The runtime preset (fails naming the presets when there is none). */}}
{{- define "imgbridge.preset" -}}
{{- $p := get .Values.runtimes .Values.runtime -}}
{{- if not $p -}}
{{- fail (printf "runtime %q: no such preset (one of: %s)" .Values.runtime (keys .Values.runtimes | sortAlpha | join ", ")) -}}
{{- end -}}
{{- toJson $p -}}
{{- end -}}

{{/* containerd's config file on the node ("" = none mounted). */}}
{{- define "imgbridge.containerdConfig" -}}
{{- if eq .Values.containerdConfig "-" -}}
{{- else if .Values.containerdConfig -}}
{{- .Values.containerdConfig -}}
{{- else -}}
{{- (include "imgbridge.preset" . | fromJson).config | default "" -}}
{{- end -}}
{{- end -}}

{{/* The directory of containerd's config to mount: "" when none, or when the socket's mount already holds it. */}}
{{- define "imgbridge.containerdConfigDir" -}}
{{- with include "imgbridge.containerdConfig" . -}}
{{- if ne (dir .) (include "imgbridge.upstream" $ | dir) -}}
{{- dir . -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Where /metrics, /healthz and /readyz listen (metrics.listen). */}}
{{- define "imgbridge.metricsListen" -}}
{{- if .Values.metrics.listen -}}
{{- .Values.metrics.listen -}}
{{- else if .Values.hostNetwork -}}
{{- printf "127.0.0.1:%v" .Values.metrics.port -}}
{{- else -}}
{{- printf "[::]:%v" .Values.metrics.port -}}
{{- end -}}
{{- end -}}

{{/* containerd's socket on the node: containerdSocket, else the runtime preset. */}}
{{- define "imgbridge.upstream" -}}
{{- if .Values.containerdSocket -}}
{{- .Values.containerdSocket -}}
{{- else -}}
{{- required (printf "runtimes.%s.socket" .Values.runtime) (include "imgbridge.preset" . | fromJson).socket -}}
{{- end -}}
{{- end -}}

{{- define "imgbridge.listen" -}}
{{- printf "%s/%s" (.Values.socket.dir | trimSuffix "/") .Values.socket.name -}}
{{- end -}}

{{/* A group name (not a gid) is looked up in the node's /etc/group. */}}
{{- define "imgbridge.groupByName" -}}
{{- $g := toString .Values.socket.group -}}
{{- if and $g (not (regexMatch "^[0-9]+$" $g)) -}}true{{- end -}}
{{- end -}}

{{/*
config.toml: the chart's values over .Values.config. Keys are written as
TOML with JSON-encoded values (strings, booleans, numbers and arrays of
them are the same in both); import.dirs as an array of inline tables.
*/}}
{{- define "imgbridge.config" -}}
{{- $c := deepCopy (.Values.config | default dict) -}}
{{- $_ := set $c "listen" (include "imgbridge.listen" .) -}}
{{- $_ := set $c "upstream" (include "imgbridge.upstream" .) -}}
{{- $_ := set $c "socket_mode" (toString .Values.socket.mode) -}}
{{- $_ := set $c "socket_group" (toString .Values.socket.group) -}}
{{- /* The surge pod takes the socket over from the old one (docs/daemonset.md). */ -}}
{{- $_ := set $c "socket_handover" true -}}
{{- /* The old pod drains while the new one serves: let a write in flight
     (a build's layer) finish, up to the grace period less 5 s. */ -}}
{{- if not (hasKey $c "drain_timeout") -}}
{{- $_ := set $c "drain_timeout" (printf "%ds" (max 1 (sub (int .Values.terminationGracePeriodSeconds) 5))) -}}
{{- end -}}
{{- $r := get $c "replication" | default dict -}}
{{- $_ := set $r "source_namespaces" .Values.replication.sourceNamespaces -}}
{{- $_ := set $r "target_namespaces" .Values.replication.targetNamespaces -}}
{{- $_ := set $c "replication" $r -}}
{{- $i := get $c "import" | default dict -}}
{{- $_ := set $i "state_file" (printf "%s/import-state.json" (.Values.stateDir | trimSuffix "/")) -}}
{{- $_ := set $c "import" $i -}}
{{- $m := get $c "metrics" | default dict -}}
{{- $_ := set $m "listen" (include "imgbridge.metricsListen" .) -}}
{{- $_ := set $c "metrics" $m -}}
{{- if .Values.registry.enabled -}}
{{- if not .Values.hostNetwork -}}
{{- fail "registry.enabled needs hostNetwork: true (the endpoint listens on the node's loopback, where containerd and the tools on the node reach it)" -}}
{{- end -}}
{{- $g := get $c "registry" | default dict -}}
{{- $_ := set $g "listen" (printf "127.0.0.1:%v" .Values.registry.port) -}}
{{- with .Values.registry.localRegistryHosting.host -}}
{{- $h := regexReplaceAll ":[0-9]+$" . "" | trimPrefix "[" | trimSuffix "]" -}}
{{- if not (has $h (list "localhost" "127.0.0.1" "::1")) -}}
{{- $_ := set $g "hosts" (append (get $g "hosts" | default list) $h | uniq) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $c "registry" $g -}}
{{- end -}}
{{- $l := get $c "log" | default dict -}}
{{- $_ := set $l "format" .Values.log.format -}}
{{- $_ := set $l "filter" .Values.log.filter -}}
{{- $_ := set $c "log" $l -}}
{{- range $k := keys $c | sortAlpha }}
{{- $v := get $c $k }}
{{- if not (kindIs "map" $v) }}
{{ $k }} = {{ toJson $v }}
{{- end }}
{{- end }}
{{- range $k := keys $c | sortAlpha }}
{{- $t := get $c $k }}
{{- if kindIs "map" $t }}
{{ printf "\n[%s]" $k }}
{{- range $kk := keys $t | sortAlpha }}
{{- if not (and (eq $k "import") (eq $kk "dirs")) }}
{{ $kk }} = {{ get $t $kk | toJson }}
{{- end }}
{{- end }}
{{- if eq $k "import" }}
{{- if $.Values.importDirs }}
dirs = [
{{- range $d := $.Values.importDirs }}
  { path = {{ required "importDirs[].path" $d.path | toJson }}, namespace = {{ $d.namespace | default "k8s.io" | toJson }} },
{{- end }}
]
{{- else }}
dirs = []
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Where tools push: registry.localRegistryHosting.host, else the node's loopback. */}}
{{- define "imgbridge.registryHost" -}}
{{- .Values.registry.localRegistryHosting.host | default (printf "localhost:%v" .Values.registry.port) -}}
{{- end -}}
