{{/*
Names: chart name, full name (<release>-<chart>, 63 characters at most), per component.
*/}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
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

{{/* The name of one component's objects: (dict "root" $ "component" "router") */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root | trunc 52 | trimSuffix "-") .component }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: (dict "root" $ "component" "prefill") */}}
{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.componentSelectorLabels" -}}
{{ include "pdserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdserve.plannerEnabled" -}}
{{- if ne .Values.autoscaling.mode "none" }}true{{ end }}
{{- end }}

{{/*
Redis. The password never appears in a manifest: REDIS_PASSWORD comes from a Secret and
Kubernetes expands $(REDIS_PASSWORD) into PDSERVE_REDIS_URL when the container starts.
*/}}
{{- define "pdserve.redis.host" -}}
{{- include "pdserve.componentName" (dict "root" . "component" "redis") }}
{{- end }}

{{/* The Secret and key holding the Redis password; empty when there is none. */}}
{{- define "pdserve.redis.secretName" -}}
{{- if eq .Values.redis.mode "external" }}
{{- .Values.redis.external.existingSecret }}
{{- else if .Values.redis.bundled.auth.enabled }}
{{- default (include "pdserve.redis.host" .) .Values.redis.bundled.auth.existingSecret }}
{{- end }}
{{- end }}

{{- define "pdserve.redis.secretKey" -}}
{{- if eq .Values.redis.mode "external" }}
{{- default "redis-password" .Values.redis.external.existingSecretKey }}
{{- else if .Values.redis.bundled.auth.existingSecret }}
{{- default "redis-password" .Values.redis.bundled.auth.existingSecretKey }}
{{- else }}redis-password
{{- end }}
{{- end }}

{{/* PDSERVE_REDIS_URL with $(REDIS_PASSWORD) in place of the password. */}}
{{- define "pdserve.redis.url" -}}
{{- $auth := "" }}
{{- if include "pdserve.redis.secretName" . }}
{{- $auth = ":$(REDIS_PASSWORD)@" }}
{{- end }}
{{- if eq .Values.redis.mode "external" }}
{{- $url := urlParse .Values.redis.external.url }}
{{- printf "%s://%s%s%s" $url.scheme $auth $url.host (default "/0" $url.path) }}
{{- with $url.query }}?{{ . }}{{ end }}
{{- else }}
{{- printf "redis://%s%s:%d/0" $auth (include "pdserve.redis.host" .) (int .Values.redis.bundled.port) }}
{{- end }}
{{- end }}

{{/* Environment every pdserve container gets: Redis, key prefix, log level, caches. */}}
{{- define "pdserve.env" -}}
{{- $secret := include "pdserve.redis.secretName" . }}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "pdserve.redis.secretKey" . }}
{{- end }}
- name: PDSERVE_REDIS_URL
  value: {{ include "pdserve.redis.url" . | quote }}
- name: PDSERVE_KEY_PREFIX
  value: {{ .Values.redis.keyPrefix | quote }}
- name: PDSERVE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: PDSERVE_CACHE_DIR
  value: /cache/pdserve
- name: XDG_CACHE_HOME
  value: /cache
- name: HF_HOME
  value: /cache/huggingface
- name: MPLCONFIGDIR
  value: /tmp/matplotlib
- name: TMPDIR
  value: /tmp
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The writable directories of a pdserve container (the root filesystem is read-only). */}}
{{- define "pdserve.scratchVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- end }}

{{- define "pdserve.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- end }}

{{/* One topology spread constraint for a component: (dict "root" $ "component" "router") */}}
{{- define "pdserve.topologySpread" -}}
{{- $spread := .root.Values.topologySpread }}
{{- if $spread.enabled }}
topologySpreadConstraints:
  - maxSkew: {{ $spread.maxSkew | default 1 }}
    topologyKey: {{ $spread.topologyKey | default "kubernetes.io/hostname" }}
    whenUnsatisfiable: {{ $spread.whenUnsatisfiable | default "ScheduleAnyway" }}
    labelSelector:
      matchLabels:
        {{- include "pdserve.componentSelectorLabels" . | nindent 8 }}
    matchLabelKeys:
      - pod-template-hash
{{- end }}
{{- end }}

{{/* nodeSelector, tolerations and affinity of a component's values. */}}
{{- define "pdserve.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "pdserve.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Checks of combinations the schema cannot express; each failure says what to change.
*/}}
{{- define "pdserve.validate" -}}
{{- if eq .Values.redis.mode "external" }}
{{- if not .Values.redis.external.url }}
{{- fail "redis.external.url is required when redis.mode is external (e.g. redis://redis.example:6379/0)" }}
{{- end }}
{{- end }}
{{- if and (eq .Values.autoscaling.mode "keda") (not .Values.autoscaling.keda.serverAddress) }}
{{- fail "autoscaling.keda.serverAddress (the Prometheus KEDA queries) is required when autoscaling.mode is keda" }}
{{- end }}
{{- if hasKey .Values.autoscaling.hpa.extraMetricLabels "pool" }}
{{- fail "autoscaling.hpa.extraMetricLabels must not set pool: the chart selects each pool's metric itself" }}
{{- end }}
{{- range $label := list "pool" "namespace" }}
{{- if hasKey $.Values.autoscaling.keda.extraMetricLabels $label }}
{{- fail (printf "autoscaling.keda.extraMetricLabels must not set %s: the chart's query sets it itself" $label) }}
{{- end }}
{{- end }}
{{- if hasKey .Values.prefill "speculative" }}
{{- fail "prefill.speculative: prefill workers never speculate (they sample only the first token); set decode.speculative" }}
{{- end }}
{{- with .Values.decode.speculative }}
{{- if and (eq .method "draft") (not .draftModel) }}
{{- fail "decode.speculative.draftModel is required when decode.speculative.method is draft" }}
{{- end }}
{{- end }}
{{- range $pool := list "prefill" "decode" }}
{{- $bounds := (index $.Values $pool).autoscaling }}
{{- if gt (int $bounds.minReplicas) (int $bounds.maxReplicas) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) must not exceed %s.autoscaling.maxReplicas (%d)" $pool (int $bounds.minReplicas) $pool (int $bounds.maxReplicas)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A pool's speculative decoding flags (decode.speculative): none while its method is off;
a knob left null is not passed, so the worker's default holds. Integer knobs are printed
as integers (values arrive as floats: %v would print 1e+06).
*/}}
{{- define "pdserve.speculativeArgs" -}}
{{- with .speculative }}
{{- if ne .method "off" }}
{{- $spec := . }}
{{- $integerFlags := dict "numSpeculativeTokens" "--num-speculative-tokens" "maxTreeNodes" "--max-tree-nodes" "maxVerifyTokens" "--max-verify-tokens" "ngramMin" "--ngram-min" "ngramMax" "--ngram-max" "ngramBranches" "--ngram-branches" "draftNumBlocks" "--draft-num-blocks" }}
- --speculative={{ .method }}
{{- range $key, $flag := $integerFlags }}
{{- $value := index $spec $key }}
{{- if not (kindIs "invalid" $value) }}
- {{ printf "%s=%d" $flag (int64 $value) | quote }}
{{- end }}
{{- end }}
{{- if not (kindIs "invalid" .minAcceptance) }}
- {{ printf "--min-acceptance=%v" .minAcceptance | quote }}
{{- end }}
{{- with .draftModel }}
- {{ printf "--draft-model=%s" . | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A size value as the CLI takes it: "4GiB" as is, a number as an integer (YAML numbers
arrive as floats: 1073741824 would print as 1.073741824e+09). */}}
{{- define "pdserve.size" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ int64 . }}{{ end }}
{{- end }}

{{/* A pool's KV tier flags (pool.kvTiers). */}}
{{- define "pdserve.kvTierArgs" -}}
{{- with .kvTiers }}
{{- if not (kindIs "invalid" .hostBytes) }}
- {{ printf "--kv-host-tier-bytes=%s" (include "pdserve.size" .hostBytes) | quote }}
{{- end }}
{{- if .disk.enabled }}
- --kv-disk-tier-path=/var/cache/pdserve/kv-tier
- {{ printf "--kv-disk-tier-bytes=%s" (include "pdserve.size" .disk.bytes) | quote }}
{{- end }}
{{- if or (not (kindIs "invalid" .hostBytes)) .disk.enabled }}
- --kv-tier-codec={{ .codec }}
{{- end }}
{{- end }}
{{- end }}
