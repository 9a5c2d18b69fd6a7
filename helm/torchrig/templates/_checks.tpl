{{- /*
What every Kubernetes target refuses, with orchestrator/compile/checks.py's messages (after each target's
own checks, in the compiler's order): a multi-node job whose checkpoint stores all live inside one pod
(unless allowPodLocalStores), credentials written into a store's options. Arg: dict "job" "root".
*/ -}}

{{- /* torchrig.secretKeys: dotted paths of credential-like keys of an options map, depth first in key order. Args: dict "options" "prefix". Returns JSON {"paths": [...]}. */ -}}
{{- define "torchrig.secretKeys" -}}
{{- $paths := list -}}
{{- $prefix := .prefix -}}
{{- range $key, $value := .options -}}
  {{- $path := printf "%s.%s" $prefix $key -}}
  {{- if kindIs "map" $value -}}
    {{- $paths = concat $paths (include "torchrig.secretKeys" (dict "options" $value "prefix" $path) | fromJson).paths -}}
  {{- else if regexMatch "(?i)^key$|secret|passw|token|credential|private_key|account_key|connection_string|api_key|access_key" $key -}}
    {{- /* gcsfs's `token` may name an authentication method instead of holding one. */ -}}
    {{- if not (and (eq $key "token") (kindIs "string" $value) (has $value (list "anon" "google_default" "cache" "cloud" "browser"))) -}}
      {{- $paths = append $paths $path -}}
    {{- end -}}
  {{- end -}}
{{- end -}}
{{- toJson (dict "paths" $paths) -}}
{{- end -}}

{{- define "torchrig.checks" -}}
{{- $s := .job.spec -}}
{{- $maxNodes := $s.nodes.max | int -}}
{{- $shared := false -}}
{{- range $store := $s.checkpoint.stores -}}
  {{- if or $store.pvc (not (has (include "torchrig.storeScheme" $store) (list "file" "memory"))) -}}{{- $shared = true -}}{{- end -}}
{{- end -}}
{{- if and (gt $maxNodes 1) (not $shared) (not .root.Values.allowPodLocalStores) -}}
  {{- fail (printf "spec.checkpoint.stores: every store is pod-local (a file:// store without pvc is the pod's own filesystem) and spec.nodes.max is %d, so rank 0 would commit checkpoints whose shards other pods hold and lose; add a shared store: pvc: on a ReadWriteMany PersistentVolumeClaim, or an s3:// store (to accept it anyway: --allow-pod-local-stores, or the chart value allowPodLocalStores)" $maxNodes) -}}
{{- end -}}
{{- $sources := list -}}
{{- range $i, $store := $s.checkpoint.stores -}}
  {{- $sources = append $sources (dict "where" (printf "spec.checkpoint.stores[%d]" $i) "store" (printf "spec.checkpoint.stores[%d]" $i) "options" ($store.options | default dict)) -}}
{{- end -}}
{{- if $s.checkpoint.initFrom -}}
  {{- $sources = append $sources (dict "where" "spec.checkpoint.initFrom" "store" "spec.checkpoint.stores[]" "options" ($s.checkpoint.initFrom.options | default dict)) -}}
{{- end -}}
{{- range $src := $sources -}}
  {{- $paths := (include "torchrig.secretKeys" (dict "options" $src.options "prefix" (printf "%s.options" $src.where)) | fromJson).paths -}}
  {{- if $paths -}}
    {{- fail (printf "%s: credentials must not be inline for Kubernetes targets (they would be stored in the spec ConfigMap); put them in a Secret and name it in %s.secretRef: its keys (e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) become the pods' environment, which fsspec reads" (first $paths) $src.store) -}}
  {{- end -}}
{{- end -}}
{{- end -}}
