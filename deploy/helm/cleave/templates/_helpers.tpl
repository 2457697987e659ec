{{/* Names and labels. */}}
{{- define "cleave.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cleave.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "decode"). */}}
{{- define "cleave.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "cleave.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "cleave.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ .Values.serviceAccount.name | default (include "cleave.fullname" .) }}
{{- else -}}
{{ .Values.serviceAccount.name | default "default" }}
{{- end -}}
{{- end -}}

{{- define "cleave.redisUrl" -}}
{{- if .Values.redis.externalUrl -}}
{{ .Values.redis.externalUrl }}
{{- else if .Values.redis.enabled -}}
redis://{{ include "cleave.fullname" . }}-redis:6379/0
{{- end -}}
{{- end -}}

{{- define "cleave.modelClaim" -}}
{{ .Values.model.pvc.existingClaim | default (printf "%s-model" (include "cleave.fullname" .)) }}
{{- end -}}

{{/*
The one place where values become Cleave's configuration: CLEAVE_<FLAG> variables,
read by the same configuration layer as the command-line flags.
*/}}
{{- define "cleave.commonEnv" -}}
- name: CLEAVE_MODEL
  value: {{ .Values.model.path | quote }}
- name: CLEAVE_LOG_LEVEL
  value: INFO
{{- with (include "cleave.redisUrl" .) }}
- name: CLEAVE_REDIS_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.tracing.otlpEndpoint }}
- name: CLEAVE_OTLP_TRACES_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: HOME
  value: /tmp
{{- end -}}

{{/* Worker env: call with (dict "root" $ "pool" $.Values.decode "role" "decode"). */}}
{{- define "cleave.workerEnv" -}}
{{- $e := .pool.engine -}}
{{- $v := .root.Values -}}
{{- if and $v.prefill.enabled $v.decode.enabled (ne $v.prefill.engine.kvCacheDtype $v.decode.engine.kvCacheDtype) -}}
{{- fail "prefill.engine.kvCacheDtype and decode.engine.kvCacheDtype differ: the decode pool reads the prefill pool's KV blocks as they are, so give both the same" -}}
{{- end -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
{{ include "cleave.commonEnv" .root }}
- name: CLEAVE_HOST
  value: $(POD_IP)
- name: CLEAVE_PORT
  value: "50051"
- name: CLEAVE_METRICS_PORT
  value: {{ .root.Values.metrics.port | quote }}
- name: CLEAVE_WORKER_ID
  value: $(POD_NAME)
- name: CLEAVE_DEVICE
  value: {{ .pool.device | quote }}
- name: CLEAVE_DTYPE
  value: {{ $e.dtype | quote }}
- name: CLEAVE_KV_CACHE_DTYPE
  value: {{ $e.kvCacheDtype | quote }}
- name: CLEAVE_BLOCK_SIZE
  value: {{ $e.blockSize | quote }}
- name: CLEAVE_KV_CACHE_MEMORY
  value: {{ $e.kvCacheMemory | quote }}
- name: CLEAVE_GPU_MEMORY_UTILIZATION
  value: {{ $e.gpuMemoryUtilization | quote }}
- name: CLEAVE_MAX_NUM_BATCHED_TOKENS
  value: {{ $e.maxNumBatchedTokens | quote }}
- name: CLEAVE_MAX_NUM_SEQS
  value: {{ $e.maxNumSeqs | quote }}
{{- if $e.maxModelLen }}
- name: CLEAVE_MAX_MODEL_LEN
  value: {{ $e.maxModelLen | quote }}
{{- end }}
- name: CLEAVE_NO_PREFIX_CACHING
  value: {{ ternary "0" "1" $e.prefixCaching | quote }}
- name: CLEAVE_KV_TRANSFER_BACKEND
  value: {{ .pool.kvTransferBackend | quote }}
# Drain within the grace period, leaving time for preStop and the exit itself.
- name: CLEAVE_DRAIN_TIMEOUT
  value: {{ max 1 (sub (int .pool.terminationGracePeriodSeconds) 15) | quote }}
{{- if eq .role "prefill" }}
- name: CLEAVE_ADVERTISE_ADDR
  value: $(POD_IP):50051
{{- end }}
{{- with .pool.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "cleave.routerEnv" -}}
{{ include "cleave.commonEnv" . }}
- name: CLEAVE_HOST
  value: 0.0.0.0
- name: CLEAVE_PORT
  value: {{ .Values.router.port | quote }}
{{- /* With Redis the router finds every worker pod in the registry; the Services are for the rest. */}}
{{- if not (include "cleave.redisUrl" .) }}
{{- if .Values.prefill.enabled }}
- name: CLEAVE_PREFILL_WORKER
  value: {{ include "cleave.fullname" . }}-prefill:50051
{{- end }}
- name: CLEAVE_DECODE_WORKER
  value: {{ include "cleave.fullname" . }}-decode:50051
{{- end }}
{{- with .Values.router.routingPolicy }}
- name: CLEAVE_ROUTING_POLICY
  value: {{ . | quote }}
{{- end }}
- name: CLEAVE_DISAGG_MIN_PROMPT_TOKENS
  value: {{ .Values.router.disaggMinPromptTokens | quote }}
{{- with .Values.model.servedModelName }}
- name: CLEAVE_SERVED_MODEL_NAME
  value: {{ . | quote }}
{{- end }}
{{- if .Values.router.apiKey.existingSecret }}
- name: CLEAVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.router.apiKey.existingSecret }}
      key: {{ .Values.router.apiKey.key }}
{{- end }}
{{- with .Values.router.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Model volume and mounts. */}}
{{- define "cleave.modelVolume" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ include "cleave.modelClaim" . }}
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath is required when model.source is hostPath" .Values.model.hostPath }}
    type: DirectoryOrCreate
{{- end }}
- name: tmp
  emptyDir: {}
{{- end -}}

{{- define "cleave.modelMounts" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ dir .Values.model.path }}
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* One-shot init container that writes the demo model into the volume when it is missing. */}}
{{- define "cleave.demoModelInit" -}}
{{- if and .Values.model.writeDemoModel (ne .Values.model.source "image") }}
initContainers:
  - name: demo-model
    image: {{ include "cleave.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: [cleave]
    args: [demo-model, --if-missing, {{ .Values.model.path | quote }}]
    env:
      - name: HOME
        value: /tmp
    securityContext: {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: {{ dir .Values.model.path }}
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end -}}

{{- define "cleave.podSecurity" -}}
securityContext: {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.image.pullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
