{{- /*
Helpers that mirror orchestrator/compile/_common.py, function by function. The compilers are the source
of truth: tests/integration/test_helm.py renders this chart and `torchrig render` for the same job file and
compares the objects. Helpers that build structures return JSON (`include ... | fromJson`), because a Go
template can only return text.
*/ -}}

{{- /*
torchrig.resolve: the values of one model level resolved like pydantic would (dump_spec): null keys
dropped, sub-models and list items resolved recursively, missing non-null defaults filled in (list items
and `checkpoint.every`, which Helm's map merge cannot default), numeric quantities made strings, and a
null written for each missing key of the shape's `nulls`: a field whose null is not its default
(`gradClip: null`, no clipping). values.yaml sets those keys, and Helm deletes a key the user's values set
to null, so there its absence is the user's null; dump_spec writes it, and so must the job file here, or
the workers would read the default back. Args: dict "value" <map> "shape" <shape from _model.tpl>.
Returns JSON.
*/ -}}
{{- define "torchrig.resolve" -}}
{{- $shape := .shape -}}
{{- $out := dict -}}
{{- range $k, $x := .value -}}
  {{- if not (kindIs "invalid" $x) -}}
    {{- if and (hasKey $shape.models $k) (kindIs "map" $x) -}}
      {{- $_ := set $out $k (include "torchrig.resolve" (dict "value" $x "shape" (get $shape.models $k)) | fromJson) -}}
    {{- else if and (hasKey $shape.lists $k) (kindIs "slice" $x) -}}
      {{- $items := list -}}
      {{- range $item := $x -}}
        {{- if kindIs "map" $item -}}
          {{- $items = append $items (include "torchrig.resolve" (dict "value" $item "shape" (get $shape.lists $k)) | fromJson) -}}
        {{- else -}}
          {{- $items = append $items $item -}}
        {{- end -}}
      {{- end -}}
      {{- $_ := set $out $k $items -}}
    {{- else if and (has $k $shape.quantities) (or (kindIs "float64" $x) (kindIs "int64" $x) (kindIs "int" $x)) -}}
      {{- /* The model turns a numeric quantity into its string; avoid Go's 1e+06 for whole numbers. */ -}}
      {{- if eq ($x | int64 | float64) ($x | float64) -}}
        {{- $_ := set $out $k ($x | int64 | toString) -}}
      {{- else -}}
        {{- $_ := set $out $k (toString $x) -}}
      {{- end -}}
    {{- else -}}
      {{- $_ := set $out $k $x -}}
    {{- end -}}
  {{- end -}}
{{- end -}}
{{- range $k, $d := $shape.defaults -}}
  {{- if not (hasKey $out $k) -}}
    {{- $_ := set $out $k $d -}}
  {{- end -}}
{{- end -}}
{{- range $k := $shape.nulls -}}
  {{- if not (hasKey $out $k) -}}
    {{- $_ := set $out $k nil -}}
  {{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{- /* torchrig.job: the resolved TrainingJob (the values minus the chart-only keys), as JSON. */ -}}
{{- define "torchrig.job" -}}
{{- $shape := include "torchrig.modelShape" . | fromJson -}}
{{- include "torchrig.resolve" (dict "value" (pick .Values "apiVersion" "kind" "metadata" "spec") "shape" $shape) -}}
{{- end -}}

{{- /* torchrig.elastic: "true" when the job runs elastic (nodes.min < nodes.max and not fixedSize). Args: dict "job" "root". */ -}}
{{- define "torchrig.elastic" -}}
{{- $nodes := .job.spec.nodes -}}
{{- if and (lt ($nodes.min | int) ($nodes.max | int)) (not .root.Values.fixedSize) -}}true{{- end -}}
{{- end -}}

{{- /* Names: the job's, and those derived from it; at most 63 characters (each target's name rule keeps
the job name short enough that only the chart-only dashboard ConfigMap can be cut). */ -}}
{{- define "torchrig.name" -}}
{{- .metadata.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "torchrig.configmapName" -}}
{{- printf "%s-spec" .metadata.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "torchrig.runtimeName" -}}
{{- .spec.kubernetes.runtimeRef | default (printf "torchrig-%s" .metadata.name) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "torchrig.dashboardName" -}}
{{- printf "%s-dashboard" .metadata.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /*
torchrig.labels: the user's metadata.labels, then torchrig's (which win). Exactly the compiler's labels:
no helm.sh/chart or release labels, so that `helm template` and `torchrig render` agree object for object.
Args: dict "job" "component". Returns JSON.
*/ -}}
{{- define "torchrig.labels" -}}
{{- $name := include "torchrig.name" .job -}}
{{- $own := dict
  "app.kubernetes.io/name" "torchrig"
  "app.kubernetes.io/instance" $name
  "app.kubernetes.io/managed-by" "torchrig"
  "app.kubernetes.io/component" .component
  "torchrig.io/job" $name -}}
{{- toJson (mergeOverwrite (deepCopy .job.metadata.labels) $own) -}}
{{- end -}}

{{- /* torchrig.selectorLabels: the labels that select the job's worker pods. Arg: the job. Returns JSON. */ -}}
{{- define "torchrig.selectorLabels" -}}
{{- $name := include "torchrig.name" . -}}
{{- toJson (dict "app.kubernetes.io/instance" $name "torchrig.io/job" $name) -}}
{{- end -}}

{{- /* torchrig.objectMeta: metadata of a top-level object. Args: dict "job" "component" ["name"] ["cluster" true]. Returns JSON. */ -}}
{{- define "torchrig.objectMeta" -}}
{{- $meta := dict "name" (.name | default (include "torchrig.name" .job)) -}}
{{- if not .cluster -}}
  {{- $_ := set $meta "namespace" .job.metadata.namespace -}}
{{- end -}}
{{- $_ := set $meta "labels" (include "torchrig.labels" . | fromJson) -}}
{{- if .job.metadata.annotations -}}
  {{- $_ := set $meta "annotations" (deepCopy .job.metadata.annotations) -}}
{{- end -}}
{{- toJson $meta -}}
{{- end -}}

{{- /* torchrig.podLabels: metadata.labels, spec.kubernetes.podLabels, then torchrig's own labels (component worker or .component), which win: the NetworkPolicy and the PodMonitor select the job's pods by them. Arg: the job, or dict "job" "component". Returns JSON. */ -}}
{{- define "torchrig.podLabels" -}}
{{- $job := .job | default . -}}
{{- $merged := mergeOverwrite (deepCopy $job.metadata.labels) (deepCopy $job.spec.kubernetes.podLabels) -}}
{{- $withPod := set (deepCopy $job) "metadata" (set (deepCopy $job.metadata) "labels" $merged) -}}
{{- toJson (include "torchrig.labels" (dict "job" $withPod "component" (.component | default "worker")) | fromJson) -}}
{{- end -}}

{{- /* torchrig.jobSecretName: the Secret of the job's own secret (compile/_common.py job_secret_name). Arg: the job. */ -}}
{{- define "torchrig.jobSecretName" -}}
{{- printf "%s-job-secret" (include "torchrig.name" .) -}}
{{- end -}}

{{- /* torchrig.podAnnotations: metadata.annotations, Prometheus scrape hints, then podAnnotations. Arg: the job. Returns JSON. */ -}}
{{- define "torchrig.podAnnotations" -}}
{{- $out := deepCopy .metadata.annotations -}}
{{- if .spec.metrics.enabled -}}
  {{- $_ := mergeOverwrite $out (dict "prometheus.io/scrape" "true" "prometheus.io/port" (.spec.metrics.port | int | toString) "prometheus.io/path" "/metrics") -}}
{{- end -}}
{{- toJson (mergeOverwrite $out (deepCopy .spec.kubernetes.podAnnotations)) -}}
{{- end -}}

{{- /*
torchrig.metricsPorts: local rank r serves on metrics.port + r, port `metrics` (r = 0) or `metrics-r<r>`
(IANA service names are at most 15 characters). Arg: the job. Returns JSON {"ports": [...]}.
*/ -}}
{{- define "torchrig.metricsPorts" -}}
{{- $ports := list -}}
{{- if .spec.metrics.enabled -}}
  {{- $base := .spec.metrics.port | int -}}
  {{- range $r := until (.spec.procsPerNode | int) -}}
    {{- $name := ternary "metrics" (printf "metrics-r%d" $r) (eq $r 0) -}}
    {{- $ports = append $ports (dict "name" $name "containerPort" (add $base $r) "protocol" "TCP") -}}
  {{- end -}}
{{- end -}}
{{- toJson (dict "ports" $ports) -}}
{{- end -}}

{{- /* torchrig.resources: requests = limits (Guaranteed QoS), GPUs as an extended resource. Arg: the job. Returns JSON. */ -}}
{{- define "torchrig.resources" -}}
{{- $res := .spec.resources -}}
{{- $requests := dict "cpu" $res.cpu "memory" $res.memory -}}
{{- $limits := dict "cpu" $res.cpu "memory" $res.memory -}}
{{- if gt ($res.gpus | int) 0 -}}
  {{- $_ := set $requests $res.gpuResource ($res.gpus | int) -}}
  {{- $_ := set $limits $res.gpuResource ($res.gpus | int) -}}
{{- end -}}
{{- /* Ephemeral storage is requested only: the kubelet evicts a pod over its limit. */ -}}
{{- if not (kindIs "invalid" $res.ephemeralStorage) -}}
  {{- $_ := set $requests "ephemeral-storage" $res.ephemeralStorage -}}
{{- end -}}
{{- toJson (dict "requests" $requests "limits" $limits) -}}
{{- end -}}

{{- /*
torchrig.env: the backend -> worker contract (docs/architecture.md), then spec.kubernetes.env. A key of
spec.kubernetes.env that names a built-in variable replaces its value in place; the others follow in
key order (Helm's maps are sorted; the compiler keeps the job file's order). Arg: the job. Returns JSON {"env": [...]}.
*/ -}}
{{- define "torchrig.env" -}}
{{- $user := .spec.kubernetes.env -}}
{{- $builtin := list
  (list "TORCHRIG_SPEC" "/etc/torchrig/job.yaml")
  (list "TORCHRIG_RUN_DIR" "/var/run/torchrig")
  (list "TORCHRIG_JOB_SECRET_FILE" "/etc/torchrig-secret/job-secret")
  (list "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" "1")
  (list "PYTHONUNBUFFERED" "1") -}}
{{- /* training.preemption_timing.launcher_env: torchrun's shutdown timeout above the grace, the extra signal it forwards. */ -}}
{{- $grace := .spec.restarts.preemptGraceSeconds | float64 -}}
{{- if gt $grace 0.0 -}}
  {{- $builtin = append $builtin (list "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" (add (ceil $grace | int) 5 | toString)) -}}
  {{- with .spec.restarts.preemptSignal -}}
    {{- $builtin = append $builtin (list "PET_SIGNALS_TO_HANDLE" (printf "SIGTERM,SIGINT,SIGHUP,SIGQUIT,%s" .)) -}}
  {{- end -}}
{{- end -}}
{{- /* orchestrator.compile._common.inplace_store_env: one node that may recover in place has its torchrun agent host the store;
       several nodes (launched over the c10d rendezvous by every target), or one with standby nodes, share the rendezvous store. */ -}}
{{- $r := .spec.restarts -}}
{{- if and (ne $r.mode "restart") (ge ($r.spares | int) 1) -}}
  {{- $standby := and (eq .spec.kubernetes.target "pytorchjob") (gt (.spec.restarts.spareNodes | int) 0) -}}
  {{- if and (eq (.spec.nodes.max | int) 1) (not $standby) -}}
    {{- if ge (.spec.procsPerNode | int) 2 -}}
      {{- $builtin = append $builtin (list "TORCHRIG_INPLACE_STORE" "agent") -}}
    {{- end -}}
  {{- else -}}
    {{- $builtin = append $builtin (list "TORCHRIG_INPLACE_STORE" "rdzv") -}}
  {{- end -}}
{{- end -}}
{{- $env := list -}}
{{- $names := list -}}
{{- range $pair := $builtin -}}
  {{- $name := index $pair 0 -}}
  {{- $names = append $names $name -}}
  {{- $env = append $env (dict "name" $name "value" (ternary (get $user $name) (index $pair 1) (hasKey $user $name))) -}}
{{- end -}}
{{- /* The node the pod runs on (downward API): the machine workers name in metrics and sdc events. */ -}}
{{- $env = append $env (dict "name" "TORCHRIG_NODE_NAME" "valueFrom" (dict "fieldRef" (dict "fieldPath" "spec.nodeName"))) -}}
{{- range $name, $value := $user -}}
  {{- if not (has $name $names) -}}
    {{- $env = append $env (dict "name" $name "value" $value) -}}
  {{- end -}}
{{- end -}}
{{- toJson (dict "env" $env) -}}
{{- end -}}

{{- /* torchrig.placement: service account, priority class, node selector, tolerations, pull secrets. Arg: the job. Returns JSON. */ -}}
{{- define "torchrig.placement" -}}
{{- $k := .spec.kubernetes -}}
{{- $out := dict -}}
{{- if $k.serviceAccount -}}{{- $_ := set $out "serviceAccountName" $k.serviceAccount -}}{{- end -}}
{{- if $k.priorityClass -}}{{- $_ := set $out "priorityClassName" $k.priorityClass -}}{{- end -}}
{{- if $k.nodeSelector -}}{{- $_ := set $out "nodeSelector" $k.nodeSelector -}}{{- end -}}
{{- if $k.tolerations -}}{{- $_ := set $out "tolerations" $k.tolerations -}}{{- end -}}
{{- if $k.imagePullSecrets -}}
  {{- $secrets := list -}}
  {{- range $n := $k.imagePullSecrets -}}{{- $secrets = append $secrets (dict "name" $n) -}}{{- end -}}
  {{- $_ := set $out "imagePullSecrets" $secrets -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{- /* torchrig.workerProgram: what torchrun starts on every rank. */ -}}
{{- define "torchrig.workerProgram" -}}
["-m","training","--spec","/etc/torchrig/job.yaml"]
{{- end -}}
