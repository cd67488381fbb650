{{/*
Names and labels, after `helm create`'s helpers.  Every object of the chart takes its
labels from here so that `kubectl get all -l app.kubernetes.io/instance=<release>` finds
all of them.
*/}}

{{/* The chart's name, shortened to a DNS label. */}}
{{- define "warmpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The fully qualified app name, e.g. "warmpool" for release "warmpool", "prod-warmpool" for
release "prod".  Truncated to 63 characters because some fields are limited to a DNS label.
*/}}
{{- define "warmpool.fullname" -}}
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

{{/* "warmpool-0.1.0", for the helm.sh/chart label. */}}
{{- define "warmpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels every object carries. */}}
{{- define "warmpool.labels" -}}
helm.sh/chart: {{ include "warmpool.chart" . }}
{{ include "warmpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: warmpool
{{- end }}

{{/*
The operator pod's selector labels.  Immutable in a Deployment once created: never add a
value-dependent label here.
*/}}
{{- define "warmpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "warmpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "warmpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "warmpool.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image's repository, required: no registry publishes warmpool's images, so the chart
names none and says how to get them into one (README.md, "Images"). */}}
{{- define "warmpool.imageRepository" -}}
{{- $key := index . 0 }}{{- $image := index . 1 }}
{{- required (printf "%s is required: warmpool publishes no images, so build them and push them to a registry your nodes pull from (from a warmpool checkout: `warmpool images build --registry REGISTRY --push`), then install with --set image.repository=REGISTRY/warmpool-operator --set workerImage.repository=REGISTRY/warmpool-worker (the chart's README, Images)" $key) $image.repository }}
{{- end }}

{{/* The operator image: digest wins over tag; the tag defaults to the chart's appVersion. */}}
{{- define "warmpool.image" -}}
{{- $repository := include "warmpool.imageRepository" (list "image.repository" .Values.image) }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The default worker image: digest wins over tag; the tag defaults to the chart's appVersion. */}}
{{- define "warmpool.workerImage" -}}
{{- $repository := include "warmpool.imageRepository" (list "workerImage.repository" .Values.workerImage) }}
{{- if .Values.workerImage.digest }}
{{- printf "%s@%s" $repository .Values.workerImage.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.workerImage.tag) }}
{{- end }}
{{- end }}

{{/*
The namespaces the operator watches when not cluster-wide, as a list (JSON, for fromJsonArray):
watch.namespaces, or the release's namespace when that list is empty.
*/}}
{{- define "warmpool.watchNamespaces" -}}
{{- if .Values.watch.namespaces }}
{{- .Values.watch.namespaces | uniq | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{/* The activator's names and labels: its own component, so no selector of the operator's picks it. */}}
{{- define "warmpool.activatorName" -}}
{{- printf "%s-activator" (include "warmpool.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "warmpool.activatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "warmpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: activator
{{- end }}

{{- define "warmpool.activatorLabels" -}}
helm.sh/chart: {{ include "warmpool.chart" . }}
{{ include "warmpool.activatorSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: warmpool
{{- end }}
