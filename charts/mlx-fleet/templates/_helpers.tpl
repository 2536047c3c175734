{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "mlx-fleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: the release name, prefixed with the chart name unless it contains it. */}}
{{- define "mlx-fleet.fullname" -}}
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

{{- define "mlx-fleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every resource that are not selector labels. */}}
{{- define "mlx-fleet.commonLabels" -}}
helm.sh/chart: {{ include "mlx-fleet.chart" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mlx-fleet
{{- end }}

{{/* Labels for every operator resource (and the cluster-wide ones). */}}
{{- define "mlx-fleet.labels" -}}
{{ include "mlx-fleet.commonLabels" . }}
{{ include "mlx-fleet.selectorLabels" . }}
{{- end }}

{{/* Labels that select the operator pods; never change them after a release (immutable selector). */}}
{{- define "mlx-fleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mlx-fleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels for every router resource. */}}
{{- define "mlx-fleet.routerLabels" -}}
{{ include "mlx-fleet.commonLabels" . }}
{{ include "mlx-fleet.routerSelectorLabels" . }}
{{- end }}

{{/* Labels that select the router pods; never change them after a release (immutable selector). */}}
{{- define "mlx-fleet.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "mlx-fleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{/* The router's name (Deployment, Service, PodDisruptionBudget, ServiceMonitor). */}}
{{- define "mlx-fleet.routerName" -}}
{{- printf "%s-router" (include "mlx-fleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The fleet router URL clients use (the operator's --router-url, each ModelDeployment's
status.router): values router.url, else the router Service's in-cluster URL when the chart
deploys the router, else empty (no router). */}}
{{- define "mlx-fleet.routerURL" -}}
{{- if .Values.router.url }}
{{- .Values.router.url | trimSuffix "/" }}
{{- else if .Values.router.enabled }}
{{- $port := int .Values.router.service.port }}
{{- printf "http://%s.%s.svc%s" (include "mlx-fleet.routerName" .) .Release.Namespace (ternary "" (printf ":%d" $port) (eq $port 80)) }}
{{- end }}
{{- end }}

{{/* etcd client flags shared by the operator and the router (both parse them with
mlx_fleet.etcd_credentials). Argument: dict root (the chart's top context), tls (a TLS Secret
name or ""), username (or ""). The files are mounted by "mlx-fleet.etcdMounts". */}}
{{- define "mlx-fleet.etcdArgs" -}}
- --etcd-endpoint={{ first .root.Values.etcd.endpoints }}
{{- with .root.Values.etcd.prefix }}
- --etcd-prefix={{ . }}
{{- end }}
{{- if .tls }}
- --etcd-ca-file=/etc/mlx-fleet/etcd-tls/ca.crt
- --etcd-cert-file=/etc/mlx-fleet/etcd-tls/tls.crt
- --etcd-key-file=/etc/mlx-fleet/etcd-tls/tls.key
{{- end }}
{{- if .username }}
- --etcd-username={{ .username }}
- --etcd-password-file=/etc/mlx-fleet/etcd-auth/password
{{- end }}
{{- end }}

{{/* The volumeMounts for "mlx-fleet.etcdArgs" (same argument). */}}
{{- define "mlx-fleet.etcdMounts" -}}
{{- if .tls }}
- name: etcd-tls
  mountPath: /etc/mlx-fleet/etcd-tls
  readOnly: true
{{- end }}
{{- if .username }}
- name: etcd-auth
  mountPath: /etc/mlx-fleet/etcd-auth
  readOnly: true
{{- end }}
{{- end }}

{{/* The volumes for "mlx-fleet.etcdArgs"; argument as it plus passwordSecret (name, key). */}}
{{- define "mlx-fleet.etcdVolumes" -}}
{{- if .tls }}
- name: etcd-tls
  secret:
    secretName: {{ .tls }}
    defaultMode: 0400
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- if .username }}
- name: etcd-auth
  secret:
    secretName: {{ .passwordSecret.name }}
    defaultMode: 0400
    items:
      - key: {{ .passwordSecret.key }}
        path: password
{{- end }}
{{- end }}

{{/* Fails with a message on etcd values the operator or the router cannot use. Argument as
"mlx-fleet.etcdVolumes" plus what (the values' path, for the message). */}}
{{- define "mlx-fleet.checkEtcd" -}}
{{- if not .root.Values.etcd.endpoints }}
{{- fail "etcd.endpoints must list one etcd client URL" }}
{{- end }}
{{- if gt (len .root.Values.etcd.endpoints) 1 }}
{{- fail "etcd.endpoints: the operator accepts exactly one etcd endpoint for now" }}
{{- end }}
{{- $endpoint := first .root.Values.etcd.endpoints }}
{{- $https := hasPrefix "https://" $endpoint }}
{{- if and .tls (not $https) }}
{{- fail (printf "%s.tls.secretName needs an https:// etcd endpoint (etcd.endpoints)" .what) }}
{{- end }}
{{- if and $https (not .tls) }}
{{- fail (printf "etcd.endpoints %s is https: %s.tls.secretName must name the Secret whose ca.crt verifies etcd" $endpoint .what) }}
{{- end }}
{{- if and .username (not .passwordSecret.name) }}
{{- fail (printf "%s.auth.username needs %s.auth.passwordSecret.name (a Secret with the password)" .what .what) }}
{{- end }}
{{- /* The agents' rule (mlx_fleet/exposure.py): plain http only to loopback, never a password. */}}
{{- if and (not $https) (not .root.Values.insecure.etcdHttp) }}
{{- if not (include "mlx-fleet.isLoopbackURL" $endpoint) }}
{{- fail (printf "etcd.endpoints %s is plain http to a host that is not loopback: use https:// with etcd.tls.secretName, or accept the risk with insecure.etcdHttp (--insecure-etcd-http)" $endpoint) }}
{{- end }}
{{- if .username }}
{{- fail (printf "%s.auth.username: the etcd password would travel in cleartext to %s: use https:// with etcd.tls.secretName, or accept the risk with insecure.etcdHttp (--insecure-etcd-http)" .what $endpoint) }}
{{- end }}
{{- end }}
{{- end }}

{{/* "true" when the URL's host is loopback (localhost, 127.0.0.0/8, [::1]), else "" — the
rule of mlx_fleet.exposure.is_loopback. */}}
{{- define "mlx-fleet.isLoopbackURL" -}}
{{- if regexMatch "^[a-z]+://(localhost|127\\.[0-9]+\\.[0-9]+\\.[0-9]+|\\[::1\\])(:[0-9]+)?/?$" (lower .) }}true{{ end }}
{{- end }}

{{- define "mlx-fleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mlx-fleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "mlx-fleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}


{{/* "true" when the operator's namespaced grants go into a Role per watched namespace:
operator.watchNamespaces lists names only (a pattern can't be enumerated: then, and with no
namespaces, they stay in the ClusterRole). */}}
{{- define "mlx-fleet.rbacPerNamespace" -}}
{{- $patterns := false }}
{{- range .Values.operator.watchNamespaces }}{{ if regexMatch "[*?\\[\\]!,]" . }}{{ $patterns = true }}{{ end }}{{ end }}
{{- if and .Values.operator.watchNamespaces (not $patterns) }}true{{ end }}
{{- end }}

{{/* The operator's grants on namespaced resources (a ClusterRole's or a Role's rules). */}}
{{- define "mlx-fleet.namespacedRules" -}}
# The operator's own resources: watch them, add/remove its finalizer and kopf annotations.
- apiGroups: ["mlx-fleet.io"]
  resources: ["modeldeployments"]
  verbs: ["get", "list", "watch", "patch", "update"]
# Status written through the status subresource.
- apiGroups: ["mlx-fleet.io"]
  resources: ["modeldeployments/status"]
  verbs: ["get", "patch", "update"]
# Needed to set ownerReferences with blockOwnerDeletion when OwnerReferencesPermissionEnforcement is on.
- apiGroups: ["mlx-fleet.io"]
  resources: ["modeldeployments/finalizers"]
  verbs: ["get", "patch", "update"]
# Canaries: watch them, read their manual-action annotations, add/remove kopf's finalizer and
# annotations (the operator never creates or deletes them), and write their status.
- apiGroups: ["mlx-fleet.io"]
  resources: ["canaries"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["mlx-fleet.io"]
  resources: ["canaries/status"]
  verbs: ["get", "patch", "update"]
# kopf posts Kubernetes events about handler progress and errors.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}
