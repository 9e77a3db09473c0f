{{/*
What the DaemonSet's pod and the `helm test` pod share: the container's
security context and the host paths imgbridge needs, each mounted at its
own path on the node so config.toml names the same paths inside and out.
*/}}
{{- /*
root: it owns a socket next to containerd's (root:root 0660) and relays to
it. No privilege otherwise: the capabilities are those of the systemd unit
(chown/chmod its socket, read watched directories of any owner).
.Values.securityContext is merged over it (seLinuxOptions, …).
*/ -}}
{{- define "imgbridge.securityContext" -}}
{{- $own := dict
  "runAsUser" 0 "runAsGroup" 0 "privileged" false
  "allowPrivilegeEscalation" false "readOnlyRootFilesystem" true
  "capabilities" (dict "drop" (list "ALL") "add" (list "CHOWN" "FOWNER" "DAC_OVERRIDE" "DAC_READ_SEARCH"))
  "seccompProfile" (dict "type" "RuntimeDefault") -}}
{{- mergeOverwrite $own (deepCopy (.Values.securityContext | default dict)) | toYaml -}}
{{- end -}}

{{- /* The container's env: where containerd's config is, then extraEnv. */ -}}
{{- define "imgbridge.env" -}}
{{- with include "imgbridge.containerdConfig" . }}
- { name: IMGBRIDGE_CONTAINERD_CONFIG, value: {{ . | quote }} }
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "imgbridge.volumeMounts" -}}
# Connecting to a socket needs no write access to its mount;
# HostToContainer: a socket containerd re-creates is seen.
- name: containerd
  mountPath: {{ include "imgbridge.upstream" . | dir | quote }}
  readOnly: true
  mountPropagation: HostToContainer
{{- with include "imgbridge.containerdConfigDir" . }}
- { name: containerd-config, mountPath: {{ . | quote }}, readOnly: true }
{{- end }}
- { name: socket-dir, mountPath: {{ .Values.socket.dir | quote }} }
- { name: state, mountPath: {{ .Values.stateDir | quote }} }
- { name: config, mountPath: /etc/imgbridge, readOnly: true }
{{- if include "imgbridge.groupByName" . }}
- { name: etc-group, mountPath: /etc/group, readOnly: true }
{{- end }}
{{- range $i, $d := .Values.importDirs }}
- { name: import-{{ $i }}, mountPath: {{ $d.path | quote }} }
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "imgbridge.volumes" -}}
- name: containerd
  hostPath: { path: {{ include "imgbridge.upstream" . | dir | quote }}, type: Directory }
{{- with include "imgbridge.containerdConfigDir" . }}
- name: containerd-config
  hostPath: { path: {{ . | quote }}, type: DirectoryOrCreate }
{{- end }}
- name: socket-dir
  hostPath: { path: {{ .Values.socket.dir | quote }}, type: DirectoryOrCreate }
- name: state
  hostPath: { path: {{ .Values.stateDir | quote }}, type: DirectoryOrCreate }
- name: config
{{- if .Values.configHostPath }}
  hostPath: { path: {{ .Values.configHostPath | quote }}, type: Directory }
{{- else }}
  configMap: { name: {{ include "imgbridge.fullname" . }} }
{{- end }}
{{- if include "imgbridge.groupByName" . }}
- name: etc-group
  hostPath: { path: /etc/group, type: File }
{{- end }}
{{- range $i, $d := .Values.importDirs }}
- name: import-{{ $i }}
  hostPath: { path: {{ $d.path | quote }}, type: DirectoryOrCreate }
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}
