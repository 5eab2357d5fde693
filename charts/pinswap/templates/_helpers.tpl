{{/* Names and labels, in the usual Helm layout. */}}

{{- define "pinswap.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pinswap.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pinswap.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pinswap.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pinswap.labels" -}}
{{ include "pinswap.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* metadata: name, namespace, labels. Call with (list . NAME) */}}
{{- define "pinswap.meta" -}}
{{- $root := index . 0 -}}
name: {{ index . 1 }}
namespace: {{ $root.Release.Namespace }}
labels:
  {{- include "pinswap.labels" $root | nindent 2 }}
{{- end }}

{{- define "pinswap.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pinswap.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Cluster-scoped names carry the namespace unless it equals the full name, so
two releases never share one (a namespace cannot contain ':').
*/}}
{{- define "pinswap.clusterName" -}}
{{- $root := index . 0 -}}
{{- $base := index . 1 -}}
{{- if eq $root.Release.Namespace (include "pinswap.fullname" $root) }}
{{- $base }}
{{- else }}
{{- printf "%s:%s" $base $root.Release.Namespace | trimSuffix ":" }}
{{- end }}
{{- end }}

{{/* The MutatingWebhookConfiguration's name (a DNS subdomain: no ':'). */}}
{{- define "pinswap.webhookConfigurationName" -}}
{{- $full := include "pinswap.fullname" . -}}
{{- if eq .Release.Namespace $full }}
{{- $full }}
{{- else }}
{{- printf "%s-%s" $full .Release.Namespace | trunc 253 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pinswap.tlsSecret" -}}
{{- include "pinswap.fullname" . }}-tls
{{- end }}

{{- define "pinswap.registryAuthSecret" -}}
{{- include "pinswap.fullname" . }}-registry-auth
{{- end }}

{{- define "pinswap.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The port of an IP:PORT config value; call with (list VALUE DEFAULT). */}}
{{- define "pinswap.port" -}}
{{- $addr := toString (index . 0) -}}
{{- $port := last (splitList ":" $addr) -}}
{{- if not (regexMatch "^[0-9]{1,5}$" $port) }}
{{- fail (printf "%s: %q is not IP:PORT (e.g. 0.0.0.0:%s)" (index . 1) $addr (index . 2)) }}
{{- end }}
{{- $port }}
{{- end }}

{{- define "pinswap.webhookPort" -}}
{{- include "pinswap.port" (list (dig "server" "listen" "0.0.0.0:8443" .Values.config) "config.server.listen" "8443") }}
{{- end }}

{{- define "pinswap.healthPort" -}}
{{- include "pinswap.port" (list (dig "server" "healthListen" "0.0.0.0:8080" .Values.config) "config.server.healthListen" "8080") }}
{{- end }}

{{- define "pinswap.recovery" -}}
{{- if dig "recovery" "enabled" true .Values.config }}true{{ end }}
{{- end }}

{{/* Ignore or Fail: the value, else from config.failurePolicy. */}}
{{- define "pinswap.failurePolicy" -}}
{{- if .Values.webhook.failurePolicy }}
{{- .Values.webhook.failurePolicy }}
{{- else if eq (toString (dig "failurePolicy" "open" .Values.config)) "closed" }}
{{- "Fail" }}
{{- else }}
{{- "Ignore" }}
{{- end }}
{{- end }}

{{/* The text of config.yaml, stored in the ConfigMap and hashed for checksum/config. */}}
{{- define "pinswap.configText" -}}
{{- toYaml .Values.config }}
{{ end }}

{{/* Where the serving certificate lives in the container. */}}
{{- define "pinswap.tlsDir" -}}
{{- if .Values.certManager.enabled }}/etc/pinswap/tls{{ else }}/var/run/pinswap/tls{{ end }}
{{- end }}

{{/*
SHA-256 of the TLS setup (mode, Secret, DNS names), so a change of
certificate definition rolls the Pods.
*/}}
{{- define "pinswap.tlsChecksum" -}}
{{- $full := include "pinswap.fullname" . -}}
{{- $mode := ternary "cert-manager" "self-signed" .Values.certManager.enabled -}}
{{- $names := printf "%s.%s.svc,%s.%s.svc.cluster.local" $full .Release.Namespace $full .Release.Namespace -}}
{{- printf "%s\n%s\n%s" $mode (include "pinswap.tlsSecret" .) $names | sha256sum }}
{{- end }}
