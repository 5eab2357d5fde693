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
{{- with .Values.image.digest }}@{{ . }}{{ end }}
{{- end }}

{{/* The port of an IP:PORT config value; call with (list VALUE DEFAULT). */}}
{{- define "pinswap.port" -}}
{{- $addr := toString (index . 0) -}}
{{- $port := last (splitList ":" $addr) -}}
{{- if not (and (contains ":" $addr) (regexMatch "^[0-9]{1,5}$" $port)) }}
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

{{/* Whether the leader watches workload templates, with the Pod watcher: for
the backfill (which copies, so not under copyPolicy none), retention, the
shared usage record and the warm set (prewarm), as Config::watches_workloads
decides. */}}
{{- define "pinswap.workloads" -}}
{{- $backfill := and (dig "backfill" "enabled" true .Values.config) (ne (toString (dig "copyPolicy" "delayed" .Values.config)) "none") }}
{{- if or $backfill (dig "retention" "enabled" false .Values.config) (dig "sharing" "enabled" false .Values.config) (dig "prewarm" "enabled" false .Values.config) }}true{{ end }}
{{- end }}

{{/*
List and watch on the custom resources config.customResources turns on, a
rule per API group in the order the config names them, as `pinswap
manifests` grants them. The profiles' kinds are those of
src/config/resources.rs.
*/}}
{{- define "pinswap.customResourceRules" -}}
{{- $profiles := dict "argo-workflows" (list (list "argoproj.io" "workflows") (list "argoproj.io" "workflowtemplates") (list "argoproj.io" "cronworkflows")) "tekton" (list (list "tekton.dev" "tasks") (list "tekton.dev" "pipelines") (list "tekton.dev" "taskruns") (list "tekton.dev" "pipelineruns") (list "tekton.dev" "stepactions")) "knative-serving" (list (list "serving.knative.dev" "services") (list "serving.knative.dev" "configurations")) "kubevirt" (list (list "kubevirt.io" "virtualmachines") (list "kubevirt.io" "virtualmachineinstances")) "flux" (list (list "source.toolkit.fluxcd.io" "ocirepositories")) }}
{{- $cr := dig "customResources" dict .Values.config }}
{{- $pairs := list }}
{{- range (dig "profiles" list $cr) }}
{{- $pairs = concat $pairs (get $profiles .) }}
{{- end }}
{{- range (dig "kinds" list $cr) }}
{{- $pairs = append $pairs (list .group .resource) }}
{{- end }}
{{- $groups := list }}
{{- $byGroup := dict }}
{{- range $pairs }}
{{- $g := index . 0 }}
{{- $r := index . 1 }}
{{- if not (hasKey $byGroup $g) }}
{{- $groups = append $groups $g }}
{{- $_ := set $byGroup $g list }}
{{- end }}
{{- if not (has $r (get $byGroup $g)) }}
{{- $_ := set $byGroup $g (append (get $byGroup $g) $r) }}
{{- end }}
{{- end }}
{{- $rules := list }}
{{- range $groups }}
{{- $rules = append $rules (dict "apiGroups" (list .) "resources" (get $byGroup .) "verbs" (list "list" "watch")) }}
{{- end }}
{{- dict "rules" $rules | toYaml }}
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

{{/*
The config as pinswap reads it: .Values.config, with webhook.namespaceSelector
and webhook.objectSelector as its scope (the same selectors, given where the
chart has always taken them). The webhook's selectors are rendered from this
scope, and the leader applies it, so the two cannot drift.
*/}}
{{- define "pinswap.config" -}}
{{- $config := deepCopy .Values.config }}
{{- $scope := dict }}
{{- range $key := list "namespaceSelector" "objectSelector" }}
{{- $given := index $.Values.webhook $key }}
{{- if $given }}
{{- if hasKey (dig "scope" dict $config) $key }}
{{- fail (printf "webhook.%s and config.scope.%s: set one (they are the same selector)" $key $key) }}
{{- end }}
{{- $_ := set $scope $key $given }}
{{- end }}
{{- end }}
{{- if $scope }}
{{- $_ := set $config "scope" (merge $scope (dig "scope" dict $config)) }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* The text of config.yaml, stored in the ConfigMap and hashed for checksum/config. */}}
{{- define "pinswap.configText" -}}
{{- include "pinswap.config" . }}
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

{{/*
Seconds of a duration as pinswap writes them (2s, 1500ms, 1m30s); "" for a
form this does not read, which pinswap itself then checks at startup.
*/}}
{{- define "pinswap.seconds" -}}
{{- $d := toString . -}}
{{- if regexMatch "^([0-9]+(\\.[0-9]+)?(ms|s|m|h))+$" $d }}
{{- $total := 0.0 }}
{{- range regexFindAll "[0-9.]+(ms|s|m|h)" $d -1 }}
{{- $n := regexFind "^[0-9.]+" . | float64 }}
{{- $unit := regexFind "(ms|s|m|h)$" . }}
{{- $scale := get (dict "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0) $unit }}
{{- $total = addf $total (mulf $n $scale) }}
{{- end }}
{{- $total }}
{{- end }}
{{- end }}

{{/*
Settings that cannot work in this Deployment, refused at render time with
the key's name, as `pinswap manifests` refuses them.
*/}}
{{- define "pinswap.checks" -}}
{{- $budget := include "pinswap.seconds" (dig "server" "admissionBudget" "2s" .Values.config) }}
{{- if and $budget (ge (float64 $budget) (float64 .Values.webhook.timeoutSeconds)) }}
{{- fail (printf "config.server.admissionBudget: %v must be below webhook.timeoutSeconds (%vs), or the API server gives up first" (dig "server" "admissionBudget" "2s" .Values.config) .Values.webhook.timeoutSeconds) }}
{{- end }}
{{- range $key, $default := dict "listen" "0.0.0.0:8443" "healthListen" "0.0.0.0:8080" }}
{{- $addr := toString (dig "server" $key $default $.Values.config) }}
{{- $port := include "pinswap.port" (list $addr (printf "config.server.%s" $key) (last (splitList ":" $default))) }}
{{- $host := trimSuffix (printf ":%s" $port) $addr }}
{{- if not (has $host (list "0.0.0.0" "[::]")) }}
{{- fail (printf "config.server.%s: %s is not reachable from the Service and the kubelet's probes; listen on 0.0.0.0:%s" $key $addr $port) }}
{{- end }}
{{- if lt (atoi $port) 1024 }}
{{- fail (printf "config.server.%s: port %s needs a capability the Pod drops (it runs as UID 65532 with none); use a port from 1024 up" $key $port) }}
{{- end }}
{{- end }}
{{- if and (dig "prewarm" "enabled" false .Values.config) (not (include "pinswap.recovery" .)) }}
{{- fail "config.prewarm.enabled: true with config.recovery.enabled false: the warm set is chosen and published by the leader, which runs with recovery on" }}
{{- end }}
{{- end }}

{{/*
"true" when the leader lists the target's registries for the node agents:
the node agent is on, the allowlist has "*", the agents have no
credentials of their own to list it with (nodeAgent.registryAuthSecret),
and there is a leader (recovery.enabled).
*/}}
{{- define "pinswap.publishesRegistries" -}}
{{- $any := false -}}
{{- range (dig "source" "registries" list .Values.config) -}}
{{- if eq (toString .registry) "*" }}{{ $any = true }}{{ end -}}
{{- end -}}
{{- and .Values.nodeAgent.enabled $any (not .Values.nodeAgent.registryAuthSecret) (eq (include "pinswap.recovery" .) "true") -}}
{{- end }}

{{/*
"true" when the node agents pre-warm their nodes: the node agent is on,
config.prewarm.enabled, and there is a leader (recovery.enabled) to choose
and publish the warm set.
*/}}
{{- define "pinswap.prewarms" -}}
{{- and .Values.nodeAgent.enabled (dig "prewarm" "enabled" false .Values.config) (eq (include "pinswap.recovery" .) "true") -}}
{{- end }}
