{{/* Names: <release>-gpupool unless the release name already says gpupool, as most charts do. */}}
{{- define "gpupool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpupool.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object; `component` names the part (scheduler, deviceplugin, ...). */}}
{{- define "gpupool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "gpupool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "gpupool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpupool.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gpupool.componentLabels" -}}
{{ include "gpupool.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gpupool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "gpupool.schedulerServiceAccount" -}}{{ include "gpupool.fullname" . }}-scheduler{{- end -}}
{{- define "gpupool.devicePluginServiceAccount" -}}{{ include "gpupool.fullname" . }}-deviceplugin{{- end -}}
{{- define "gpupool.extenderServiceAccount" -}}{{ include "gpupool.fullname" . }}-extender{{- end -}}

{{- define "gpupool.leaseName" -}}
{{- default (printf "%s-scheduler" .Values.schedulerName) .Values.scheduler.leaderElection.leaseName -}}
{{- end -}}

{{/* The scheduler policy ConfigMap's data (also hashed into the pod templates' checksum annotation). */}}
{{- define "gpupool.schedulerPolicyData" -}}
policy: {{ .Values.scheduler.policy | quote }}
percentage-of-nodes-to-score: {{ .Values.scheduler.percentageOfNodesToScore | quote }}
gate-timeout: {{ .Values.scheduler.gateTimeoutSeconds | quote }}
memory-unit-mib: {{ .Values.gpuMemoryUnitMiB | quote }}
bind-workers: {{ .Values.scheduler.bindWorkers | quote }}
event-workers: {{ .Values.scheduler.eventWorkers | quote }}
{{- end -}}

{{/* Environment variables from the policy ConfigMap, one per key: GPUPOOL_<KEY>. */}}
{{- define "gpupool.schedulerPolicyEnv" -}}
{{- $cm := printf "%s-scheduler-policy" (include "gpupool.fullname" .) -}}
{{- range $key := list "policy" "percentage-of-nodes-to-score" "gate-timeout" "memory-unit-mib" "bind-workers" "event-workers" }}
- name: GPUPOOL_{{ $key | upper | replace "-" "_" }}
  valueFrom:
    configMapKeyRef:
      name: {{ $cm }}
      key: {{ $key }}
{{- end }}
{{- end -}}

{{/* Flags reading those variables (the kubelet expands $(VAR) in args). */}}
{{- define "gpupool.schedulerPolicyArgs" -}}
{{- range $key := list "policy" "percentage-of-nodes-to-score" "gate-timeout" "memory-unit-mib" "bind-workers" "event-workers" }}
- --{{ $key }}=$(GPUPOOL_{{ $key | upper | replace "-" "_" }})
{{- end }}
{{- end -}}

{{/* The extender's share of them: it has no queue to sample from and binds in the request's own call. */}}
{{- define "gpupool.extenderPolicyArgs" -}}
{{- range $key := list "policy" "gate-timeout" "memory-unit-mib" }}
- --{{ $key }}=$(GPUPOOL_{{ $key | upper | replace "-" "_" }})
{{- end }}
{{- end -}}

{{- define "gpupool.devicePluginConfig" -}}
{{- $dp := .Values.devicePlugin -}}
version: v1
migStrategy: {{ $dp.migStrategy }}
resources:
  gpu: {{ $dp.advertise.gpu }}
  mig: {{ $dp.advertise.mig }}
  gpuMemory: {{ $dp.advertise.gpuMemory }}
gpuMemory:
  unitMiB: {{ .Values.gpuMemoryUnitMiB }}
  mps: {{ $dp.mps }}
  mpsPipeDirectory: {{ $dp.mpsPipeDirectory | quote }}
  mpsShmDirectory: {{ $dp.mpsShmDirectory | quote }}
health:
  recoveryQuietPeriodSeconds: {{ $dp.healthRecoveryQuietPeriodSeconds }}
idle:
  sampleIntervalSeconds: {{ $dp.idle.sampleIntervalSeconds }}
  windowSeconds: {{ $dp.idle.windowSeconds }}
  thresholdPercent: {{ $dp.idle.thresholdPercent }}
  memoryChangePercent: {{ $dp.idle.memoryChangePercent }}
  startGraceSeconds: {{ $dp.idle.startGraceSeconds }}
metrics:
  port: {{ $dp.metricsPort }}
  bindAddress: 0.0.0.0
kubernetes:
  mode: required
{{- end -}}
