{{- /*
The hardened worker pod, mirroring orchestrator/compile/_pod.py function by function: the preflight
launcher every command starts with, the restricted security contexts with a read-only root filesystem,
the writable volumes, envFrom of the stores' Secrets, the health-check probes, the ServiceAccount token.
*/ -}}

{{- /* torchrig.launcher: `python -m training.launch --spec PATH --`, the preflight before torchrun. Returns a JSON array. */ -}}
{{- define "torchrig.launcher" -}}
["python","-m","training.launch","--spec","/etc/torchrig/job.yaml","--"]
{{- end -}}

{{- /* torchrig.terminationGrace: a worker pod's terminationGracePeriodSeconds, restarts.preemptGraceSeconds + 10 s (training.preemption_timing.pod_grace_period_seconds); nothing when preemption handling is off. Returns a JSON object. */ -}}
{{- define "torchrig.terminationGrace" -}}
{{- $grace := .spec.restarts.preemptGraceSeconds | float64 -}}
{{- if gt $grace 0.0 -}}
{{- toJson (dict "terminationGracePeriodSeconds" (add (ceil $grace | int) 10)) -}}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{- /* The `restricted` Pod Security Standard; uid 1000 is the user of every torchrig image (fsGroup makes PVCs writable). */ -}}
{{- define "torchrig.podSecurityContext" -}}
{"runAsNonRoot":true,"runAsUser":1000,"runAsGroup":1000,"fsGroup":1000,"seccompProfile":{"type":"RuntimeDefault"}}
{{- end -}}

{{- define "torchrig.containerSecurityContext" -}}
{"allowPrivilegeEscalation":false,"readOnlyRootFilesystem":true,"runAsNonRoot":true,"runAsUser":1000,"capabilities":{"drop":["ALL"]},"seccompProfile":{"type":"RuntimeDefault"}}
{{- end -}}

{{- /* torchrig.automount: the pod's ServiceAccount token, only when the job asks for it. Arg: the job. Returns JSON. */ -}}
{{- define "torchrig.automount" -}}
{{- toJson (dict "automountServiceAccountToken" (.spec.kubernetes.automountServiceAccountToken | default false)) -}}
{{- end -}}

{{- /* torchrig.under: "true" when .path is one of .roots or below one. */ -}}
{{- define "torchrig.under" -}}
{{- $path := .path -}}
{{- range $root := .roots -}}
  {{- if or (eq $path $root) (hasPrefix (printf "%s/" (trimSuffix "/" $root)) $path) -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{- /* torchrig.storeScheme / torchrig.storePath: a store URI's scheme (`file` without one) and path. Arg: the store. */ -}}
{{- define "torchrig.storeScheme" -}}
{{- if contains "://" .uri -}}{{- index (splitn "://" 2 .uri) "_0" -}}{{- else -}}file{{- end -}}
{{- end -}}

{{- define "torchrig.storePath" -}}
{{- if contains "://" .uri -}}{{- index (splitn "://" 2 .uri) "_1" -}}{{- else -}}{{- .uri -}}{{- end -}}
{{- end -}}

{{- /* torchrig.jobSecretVolume / torchrig.jobSecretMount: the job's secret, required and read-only (compile/_common.py job_secret_volume, job_secret_mount). Arg: the job. Returns JSON. */ -}}
{{- define "torchrig.jobSecretVolume" -}}
{{- toJson (dict "name" "torchrig-job-secret" "secret" (dict "secretName" (include "torchrig.jobSecretName" .) "optional" false "defaultMode" 288 "items" (list (dict "key" "job-secret" "path" "job-secret")))) -}}
{{- end -}}

{{- define "torchrig.jobSecretMount" -}}
{"name":"torchrig-job-secret","mountPath":"/etc/torchrig-secret","readOnly":true}
{{- end -}}

{{- /*
torchrig.volumes: volumes of the pod and mounts of the worker container: the spec ConfigMap, the job's secret, the writable
emptyDirs (run directory, /tmp, the cache, /dev/shm, the node-local directory unless it lies on
/dev/shm), then per file store its PVC at its path (a relative path under the run directory), or an
emptyDir at a pod-local absolute path no other mount holds. Arg: the job. Returns JSON {"volumes", "mounts"}.
*/ -}}
{{- define "torchrig.volumes" -}}
{{- $s := .spec -}}
{{- $run := "/var/run/torchrig" -}}
{{- $volumes := list
  (dict "name" "torchrig-spec" "configMap" (dict "name" (include "torchrig.configmapName" .) "items" (list (dict "key" "job.yaml" "path" "job.yaml"))))
  (include "torchrig.jobSecretVolume" . | fromJson)
  (dict "name" "torchrig-run" "emptyDir" dict)
  (dict "name" "torchrig-tmp" "emptyDir" dict)
  (dict "name" "torchrig-cache" "emptyDir" dict) -}}
{{- $mounts := list
  (dict "name" "torchrig-spec" "mountPath" "/etc/torchrig" "readOnly" true)
  (include "torchrig.jobSecretMount" . | fromJson)
  (dict "name" "torchrig-run" "mountPath" $run)
  (dict "name" "torchrig-tmp" "mountPath" "/tmp")
  (dict "name" "torchrig-cache" "mountPath" "/home/torchrig/.cache") -}}
{{- $writable := list $run "/tmp" "/home/torchrig/.cache" -}}
{{- $shm := list -}}
{{- if not (kindIs "invalid" $s.resources.sharedMemory) -}}
  {{- $shm = list "/dev/shm" -}}
  {{- $volumes = append $volumes (dict "name" "dshm" "emptyDir" (dict "medium" "Memory" "sizeLimit" $s.resources.sharedMemory)) -}}
  {{- $mounts = append $mounts (dict "name" "dshm" "mountPath" "/dev/shm") -}}
{{- end -}}
{{- $nodeLocal := $s.checkpoint.nodeLocal -}}
{{- if and $nodeLocal.enabled (not (include "torchrig.under" (dict "path" $nodeLocal.path "roots" $shm))) -}}
  {{- $volumes = append $volumes (dict "name" "torchrig-node-local" "emptyDir" dict) -}}
  {{- $mounts = append $mounts (dict "name" "torchrig-node-local" "mountPath" $nodeLocal.path) -}}
{{- end -}}
{{- $writable = concat $writable $shm -}}
{{- if $nodeLocal.enabled -}}{{- $writable = append $writable $nodeLocal.path -}}{{- end -}}
{{- range $i, $store := $s.checkpoint.stores -}}
  {{- if eq (include "torchrig.storeScheme" $store) "file" -}}
    {{- $path := include "torchrig.storePath" $store -}}
    {{- if not (hasPrefix "/" $path) -}}{{- $path = clean (printf "%s/%s" $run $path) -}}{{- end -}}
    {{- $name := printf "store-%d" $i -}}
    {{- if $store.pvc -}}
      {{- $volumes = append $volumes (dict "name" $name "persistentVolumeClaim" (dict "claimName" $store.pvc)) -}}
      {{- $mounts = append $mounts (dict "name" $name "mountPath" $path) -}}
    {{- else if not (include "torchrig.under" (dict "path" $path "roots" $writable)) -}}
      {{- $volumes = append $volumes (dict "name" $name "emptyDir" dict) -}}
      {{- $mounts = append $mounts (dict "name" $name "mountPath" $path) -}}
      {{- $writable = append $writable $path -}}
    {{- end -}}
  {{- end -}}
{{- end -}}
{{- toJson (dict "volumes" $volumes "mounts" $mounts) -}}
{{- end -}}

{{- /* torchrig.envFrom: every Secret named by stores[].secretRef, once, in store order. Arg: the job. Returns JSON {"envFrom": [...]}. */ -}}
{{- define "torchrig.envFrom" -}}
{{- $names := list -}}
{{- range $store := .spec.checkpoint.stores -}}
  {{- if and $store.secretRef (not (has $store.secretRef $names)) -}}{{- $names = append $names $store.secretRef -}}{{- end -}}
{{- end -}}
{{- $out := list -}}
{{- range $n := $names -}}{{- $out = append $out (dict "secretRef" (dict "name" $n)) -}}{{- end -}}
{{- toJson (dict "envFrom" $out) -}}
{{- end -}}

{{- /*
torchrig.probes: the liveness probe running the worker's health check, when an exporter the probe can
reach runs (metrics.enabled, bindAddress unset or local); no startup or readiness probe, so the pod is
Ready (its Service name resolves) before the rendezvous (orchestrator/compile/_pod.py probes). The check
grants torchrun's rendezvous (600 s) and the longer of a step timeout and the checkpoint I/O timeout
(--start-budget-s); liveness then about as long again. Arg: the job. Returns JSON.
*/ -}}
{{- define "torchrig.probes" -}}
{{- $m := .spec.metrics -}}
{{- $out := dict -}}
{{- if and $m.enabled (has ($m.bindAddress | default "") (list "" "0.0.0.0" "::" "127.0.0.1" "localhost")) -}}
  {{- $timeout := max (.spec.restarts.stepTimeoutSeconds | float64) (.spec.checkpoint.ioTimeoutSeconds | float64) | float64 -}}
  {{- $exec := dict "command" (list "python" "-m" "training.healthcheck" "--start-budget-s" (ceil (addf 600 $timeout) | int | toString)) -}}
  {{- $_ := set $out "livenessProbe" (dict "exec" $exec "timeoutSeconds" 10 "periodSeconds" 30 "failureThreshold" (max 3 (ceil (divf $timeout 30) | int))) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
