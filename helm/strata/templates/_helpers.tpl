{{/* Names and labels. */}}
{{- define "strata.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "strata.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "strata.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The CUDA image: image.cudaTag, else the CPU tag with "-cuda" (what `make image-cuda` builds). */}}
{{- define "strata.cudaImage" -}}
{{- $tag := .Values.image.cudaTag | default (printf "%s-cuda" (.Values.image.tag | default .Chart.AppVersion)) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* Coordinators, the deploy hook and the test pod. In gpu mode without an image.tag of
their own they run the CUDA image too: one image for every role, so a GPU install needs
only the CUDA image built (the CUDA binary runs the CPU roles as well). */}}
{{- define "strata.image" -}}
{{- if and (eq .Values.mode "gpu") (not .Values.image.tag) -}}
{{- include "strata.cudaImage" . -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* Workers: the CUDA image in gpu mode, the CPU one in cpu mode. */}}
{{- define "strata.workerImage" -}}
{{- if eq .Values.mode "gpu" -}}
{{- include "strata.cudaImage" . -}}
{{- else -}}
{{- include "strata.image" . -}}
{{- end -}}
{{- end -}}

{{/* "true" when inference needs a key (API keys or tenants are configured), else empty. */}}
{{- define "strata.keyed" -}}
{{- if or .Values.auth.apiKeys .Values.auth.apiKeysSecret .Values.tenants -}}true{{- end -}}
{{- end -}}

{{/* "true" when a model in values is fetched from a URL, else empty. */}}
{{- define "strata.fetchesModels" -}}
{{- range .Values.models }}{{ if .url }}true{{ end }}{{ end -}}
{{- end -}}

{{/* etcd client endpoints, comma-separated. */}}
{{- define "strata.etcdEndpoints" -}}
{{- if .Values.etcd.bundled -}}
{{- $name := printf "%s-etcd" (include "strata.fullname" .) -}}
{{- $ns := .Release.Namespace -}}
{{- $eps := list -}}
{{- $scheme := ternary "https" "http" (.Values.etcd.tls.enabled | default false) -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "%s://%s-%d.%s.%s.svc:2379" $scheme $name $i $name $ns) -}}
{{- end -}}
{{- join "," $eps -}}
{{- else -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- end -}}
{{- end -}}

{{- define "strata.clusterTlsSecret" -}}
{{- if eq .Values.clusterTls.mode "existingSecret" -}}
{{- .Values.clusterTls.existingSecret -}}
{{- else -}}
{{- printf "%s-cluster-tls" (include "strata.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "strata.adminSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-admin" (include "strata.fullname" .)) -}}
{{- end -}}

{{/* Environment every Strata process shares: registry, tracing. */}}
{{- define "strata.commonEnv" -}}
- name: STRATA_ETCD
  value: {{ include "strata.etcdEndpoints" . | quote }}
- name: STRATA_PREFIX
  value: {{ .Values.prefix | quote }}
- name: POD_NAME
  valueFrom: { fieldRef: { fieldPath: metadata.name } }
{{- if .Values.etcd.external.authSecret }}
- name: STRATA_ETCD_USER
  valueFrom: { secretKeyRef: { name: {{ .Values.etcd.external.authSecret }}, key: username } }
- name: STRATA_ETCD_PASSWORD
  valueFrom: { secretKeyRef: { name: {{ .Values.etcd.external.authSecret }}, key: password } }
{{- end }}
{{- if include "strata.etcdTls" . }}
- name: STRATA_ETCD_CA
  value: /etc/strata/etcd/ca.crt
{{- if or .Values.etcd.bundled .Values.etcd.external.clientCert }}
- name: STRATA_ETCD_CERT
  value: /etc/strata/etcd/tls.crt
- name: STRATA_ETCD_KEY
  value: /etc/strata/etcd/tls.key
{{- end }}
{{- end }}
{{- if .Values.monitoring.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.monitoring.otlpEndpoint | quote }}
{{- end }}
{{- end -}}

{{/* Volumes every Strata pod mounts: cluster TLS, models, etcd TLS, scratch. */}}
{{- define "strata.volumes" -}}
{{- if eq .Values.clusterTls.mode "certManager" }}
- name: cluster-tls
  projected:
    defaultMode: 0440
    sources:
      - secret: { name: {{ include "strata.fullname" . }}-coordinator-tls, items: [{ key: tls.crt, path: coordinator/tls.crt }, { key: tls.key, path: coordinator/tls.key }, { key: ca.crt, path: coordinator/ca.crt }] }
      - secret: { name: {{ include "strata.fullname" . }}-worker-tls, items: [{ key: tls.crt, path: worker/tls.crt }, { key: tls.key, path: worker/tls.key }, { key: ca.crt, path: worker/ca.crt }] }
{{- else }}
- name: cluster-tls
  secret: { secretName: {{ include "strata.clusterTlsSecret" . }}, defaultMode: 0440 }
{{- end }}
- name: tmp
  emptyDir: {}
{{- if eq .Values.modelStorage.type "pvc" }}
- name: models
  persistentVolumeClaim: { claimName: {{ .Values.modelStorage.claimName }}, readOnly: true }
{{- else if eq .Values.modelStorage.type "hostPath" }}
- name: models
  hostPath: { path: {{ .Values.modelStorage.hostPath }}, type: Directory }
{{- end }}
{{- if include "strata.etcdTls" . }}
- name: etcd-tls
  secret: { secretName: {{ include "strata.etcdTlsSecret" . }}, defaultMode: 0440 }
{{- end }}
{{- end -}}

{{- define "strata.volumeMounts" -}}
- { name: cluster-tls, mountPath: /etc/strata/tls, readOnly: true }
- { name: tmp, mountPath: /tmp }
{{- if ne .Values.modelStorage.type "none" }}
- { name: models, mountPath: {{ .Values.modelStorage.mountPath }}, readOnly: true }
{{- end }}
{{- if include "strata.etcdTls" . }}
- { name: etcd-tls, mountPath: /etc/strata/etcd, readOnly: true }
{{- end }}
{{- end -}}

{{- define "strata.podSecurity" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.runAsGroup }}
seccompProfile: { type: RuntimeDefault }
{{- end -}}

{{/* Certificate, key and CA paths of a role ("coordinator" or "worker"). */}}
{{- define "strata.tlsArgs" -}}
{{- $role := .role -}}
{{- if eq .root.Values.clusterTls.mode "certManager" -}}
- --cluster-cert=/etc/strata/tls/{{ $role }}/tls.crt
- --cluster-key=/etc/strata/tls/{{ $role }}/tls.key
- --cluster-ca=/etc/strata/tls/{{ $role }}/ca.crt
{{- else -}}
- --cluster-cert=/etc/strata/tls/{{ $role }}.crt
- --cluster-key=/etc/strata/tls/{{ $role }}.key
- --cluster-ca=/etc/strata/tls/ca.crt
{{- end -}}
{{- end -}}

{{- define "strata.firstModel" -}}
{{- with .Values.models }}{{ (first .).name }}{{ end -}}
{{- end -}}

{{/* Whether Strata reaches etcd over TLS ("true" or empty). */}}
{{- define "strata.etcdTls" -}}
{{- if .Values.etcd.bundled -}}
{{- if .Values.etcd.tls.enabled }}true{{ end -}}
{{- else if .Values.etcd.external.tlsSecret }}true{{ end -}}
{{- end -}}

{{- define "strata.etcdTlsSecret" -}}
{{- if .Values.etcd.bundled -}}
{{- printf "%s-etcd-tls" (include "strata.fullname" .) -}}
{{- else -}}
{{- .Values.etcd.external.tlsSecret -}}
{{- end -}}
{{- end -}}
