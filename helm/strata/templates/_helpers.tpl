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

{{/*
Certificates the chart generates, renewed on upgrade. Arguments: root; name (the CA's
common name); existing (the certificates' Secret as lookup finds it, or empty); ca (the
Secret keeping the CA's key, or empty); leaves (a list of {prefix, cn, ips, dns}: each
becomes <prefix>.crt and <prefix>.key).

While the existing certificates are valid past clusterTls.renewBeforeDays they are kept
as they are. Otherwise they are issued again with the CA kept in `ca` — the same CA, so
pods still holding the old ones keep trusting the new ones while they restart — or, at
first install, with a new CA valid ten times as long (at least ten years). A Secret
made before the chart kept its CA's key cannot be renewed: it is kept, and `stuck` says
so. Returns YAML: data (the Secret's data), ca (the CA Secret's data), notAfter (the
day the certificates expire, 2006-01-02), renewed, stuck.
*/}}
{{- define "strata.generatedCerts" -}}
{{- $values := .root.Values.clusterTls -}}
{{- $days := int $values.validityDays -}}
{{- if ge (int $values.renewBeforeDays) $days }}
{{- fail "clusterTls.renewBeforeDays must be less than clusterTls.validityDays" }}
{{- end -}}
{{- $existing := .existing | default dict -}}
{{- $data := get $existing "data" | default dict -}}
{{- $annotations := get (get $existing "metadata" | default dict) "annotations" | default dict -}}
{{- $notAfter := get $annotations "strata.io/not-after" | default "" -}}
{{- $caData := get (.ca | default dict) "data" | default dict -}}
{{- $deadline := now | dateModify (printf "+%dh" (mul (int $values.renewBeforeDays) 24)) | unixEpoch | int64 -}}
{{- $fresh := and $data $notAfter (gt (toDate "2006-01-02" $notAfter | unixEpoch | int64) $deadline) -}}
{{- $out := dict "renewed" false "stuck" false -}}
{{- if $fresh -}}
{{- $_ := set $out "data" $data -}}
{{- $_ := set $out "ca" $caData -}}
{{- $_ := set $out "notAfter" $notAfter -}}
{{- else if and $data (not (get $caData "ca.key")) -}}
{{- $_ := set $out "data" $data -}}
{{- $_ := set $out "notAfter" $notAfter -}}
{{- $_ := set $out "stuck" true -}}
{{- else -}}
{{- $ca := dict -}}
{{- if get $caData "ca.key" -}}
{{- $ca = buildCustomCert (get $caData "ca.crt") (get $caData "ca.key") -}}
{{- else -}}
{{- $ca = genCA .name (max (mul $days 10) 3650 | int) -}}
{{- end -}}
{{- $issued := dict "ca.crt" ($ca.Cert | b64enc) -}}
{{- range .leaves -}}
{{- $cert := genSignedCert .cn (.ips | default list) (.dns | default list) $days $ca -}}
{{- $_ := set $issued (printf "%s.crt" .prefix) ($cert.Cert | b64enc) -}}
{{- $_ := set $issued (printf "%s.key" .prefix) ($cert.Key | b64enc) -}}
{{- end -}}
{{- $_ := set $out "data" $issued -}}
{{- $_ := set $out "ca" (dict "ca.crt" ($ca.Cert | b64enc) "ca.key" ($ca.Key | b64enc)) -}}
{{- $_ := set $out "notAfter" (now | dateModify (printf "+%dh" (mul $days 24)) | date "2006-01-02") -}}
{{- $_ := set $out "renewed" true -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
The day generated certificates (the Secret `name`, its CA's key in `caName`) expire, as
the next render writes it: annotated on the pods that use them, so they restart when the
certificates are renewed, and only then.
*/}}
{{- define "strata.certsRoll" -}}
{{- $root := .root -}}
{{- $existing := lookup "v1" "Secret" $root.Release.Namespace .name | default dict -}}
{{- $notAfter := get (get (get $existing "metadata" | default dict) "annotations" | default dict) "strata.io/not-after" | default "" -}}
{{- $deadline := now | dateModify (printf "+%dh" (mul (int $root.Values.clusterTls.renewBeforeDays) 24)) | unixEpoch | int64 -}}
{{- if and $notAfter (gt (toDate "2006-01-02" $notAfter | unixEpoch | int64) $deadline) -}}
{{- $notAfter -}}
{{- else if and (get $existing "data") (not (lookup "v1" "Secret" $root.Release.Namespace .caName)) -}}
{{- $notAfter | default "kept" -}}
{{- else -}}
{{- now | dateModify (printf "+%dh" (mul (int $root.Values.clusterTls.validityDays) 24)) | date "2006-01-02" -}}
{{- end -}}
{{- end -}}

{{/* The pods' certsRoll annotations: the cluster's certificates (when generated) and the
bundled etcd's (when generated), for coordinators and workers; etcd's alone for etcd. */}}
{{- define "strata.certsAnnotations" -}}
{{- $fullname := include "strata.fullname" .root -}}
{{- if and (ne .component "etcd") (eq .root.Values.clusterTls.mode "generated") }}
strata.io/cluster-certs: {{ include "strata.certsRoll" (dict "root" .root "name" (printf "%s-cluster-tls" $fullname) "caName" (printf "%s-cluster-ca" $fullname)) | quote }}
{{- end }}
{{- if and .root.Values.etcd.bundled .root.Values.etcd.tls.enabled }}
strata.io/etcd-certs: {{ include "strata.certsRoll" (dict "root" .root "name" (printf "%s-etcd-tls" $fullname) "caName" (printf "%s-etcd-ca" $fullname)) | quote }}
{{- end }}
{{- end -}}

{{/* The Secrets of generatedCerts' answer `certs`: the certificates (`name`, annotated
with the day they expire) and the CA's key (`caName`, mounted by no pod). Both are kept
when the release is uninstalled. */}}
{{- define "strata.certSecrets" -}}
---
apiVersion: v1
kind: Secret
metadata:
  name: {{ .name }}
  labels:
    {{- include "strata.labels" .root | nindent 4 }}
  annotations:
    helm.sh/resource-policy: keep
    {{- with .certs.notAfter }}
    strata.io/not-after: {{ . | quote }}
    {{- end }}
type: Opaque
data:
  {{- toYaml .certs.data | nindent 2 }}
{{- if .certs.ca }}
---
apiVersion: v1
kind: Secret
metadata:
  name: {{ .caName }}
  labels:
    {{- include "strata.labels" .root | nindent 4 }}
  annotations:
    helm.sh/resource-policy: keep
type: Opaque
data:
  {{- toYaml .certs.ca | nindent 2 }}
{{- end }}
{{- end -}}
