{{- define "rljob.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rljob.serviceAccountName" -}}
{{- default (include "rljob.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* Selector labels; app.kubernetes.io/name is what each job's Redis NetworkPolicy admits. */}}
{{- define "rljob.selectorLabels" -}}
app.kubernetes.io/name: rljob-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rljob.labels" -}}
{{ include "rljob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
