{{- /*
What every Kubernetes target refuses, with orchestrator/compile/checks.py's messages (after each target's
own checks, in the compiler's order): a multi-node job whose checkpoint stores all live inside one pod
(unless allowPodLocalStores), credentials written into a store's options; then what torchrig's loader
refuses before any compiler runs: a credential written inline anywhere in the job. Arg: dict "job" "root".
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
{{- include "torchrig.inlineSecretChecks" . -}}
{{- end -}}

{{- /*
Inline credentials anywhere in the job, judged as orchestrator/credentials.py's `inline_secrets` judges
them (the loader's refusal), from the rules generated into _credentials.tpl. A job given to the chart as
values never passes through torchrig's loader, and the spec ConfigMap and the pods' env would carry the
secret. Each helper returns JSON (a Go template returns text); "ctx" is the loader's map context:
general, options, env or names.
*/ -}}

{{- /* torchrig.credentialShape: what a text looks like if it holds a credential, else "". Args: dict "text" "rules". */ -}}
{{- define "torchrig.credentialShape" -}}
{{- $found := "" -}}
{{- range $shape := .rules.shapes -}}
  {{- if and (not $found) (regexMatch (index $shape 1) $.text) -}}{{- $found = index $shape 0 -}}{{- end -}}
{{- end -}}
{{- $found -}}
{{- end -}}

{{- /* torchrig.nameWords: a key's words, lower case (camelCase and separators split). Arg: the name. Returns JSON {"words": [...]}. */ -}}
{{- define "torchrig.nameWords" -}}
{{- $words := list -}}
{{- range $w := regexSplit "[^A-Za-z0-9]+" (regexReplaceAll "([a-z0-9])([A-Z])" . "${1}_${2}") -1 -}}
  {{- if $w -}}{{- $words = append $words (lower $w) -}}{{- end -}}
{{- end -}}
{{- toJson (dict "words" $words) -}}
{{- end -}}

{{- /* torchrig.nameSaysSecret: "true" when a map key names a credential in its context. Args: dict "name" "ctx" "rules". */ -}}
{{- define "torchrig.nameSaysSecret" -}}
{{- $r := .rules -}}
{{- $words := (include "torchrig.nameWords" .name | fromJson).words -}}
{{- if and (ne .ctx "names") $words (not (has (last $words) $r.aboutWords)) -}}
  {{- $joined := join "" $words -}}
  {{- $yes := and (eq .ctx "options") (eq (toJson $words) "[\"key\"]") -}}
  {{- range $s := $r.secretSubstrings -}}{{- if contains $s $joined -}}{{- $yes = true -}}{{- end -}}{{- end -}}
  {{- range $w := $words -}}
    {{- if and (ne $.ctx "general") (has $w $r.secretWords) -}}{{- $yes = true -}}{{- end -}}
  {{- end -}}
  {{- if and (eq .ctx "general") (eq (toJson $words) "[\"token\"]") -}}{{- $yes = true -}}{{- end -}}
  {{- range $i, $b := $words -}}
    {{- if gt $i 0 -}}
      {{- $a := index $words (sub $i 1) -}}
      {{- if and (eq $.ctx "general") (has $a $r.tokenQualifiers) (eq $b "token") -}}{{- $yes = true -}}{{- end -}}
      {{- if and (has $a $r.keyQualifiers) (eq $b "key") -}}{{- $yes = true -}}{{- end -}}
    {{- end -}}
  {{- end -}}
  {{- if and (eq .ctx "env") (gt (len $words) 1) (eq (last $words) "key") -}}{{- $yes = true -}}{{- end -}}
  {{- if $yes -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{- /* torchrig.holdsSecretValue: "true" when a value under a credential-like name could be the credential. Args: dict "value" "name" "ctx" "rules". */ -}}
{{- define "torchrig.holdsSecretValue" -}}
{{- $r := .rules -}}
{{- if or (kindIs "float64" .value) (kindIs "int64" .value) (kindIs "int" .value) -}}
  {{- if and (eq .ctx "options") (ne (.value | float64) 0.0) -}}true{{- end -}}
{{- else if kindIs "string" .value -}}
  {{- $text := trim .value -}}
  {{- if and $text (not (has (lower $text) $r.notSecretValues)) (not (regexMatch $r.reference $text)) (not (regexMatch $r.path $text)) -}}
    {{- if not (and (has "token" (include "torchrig.nameWords" .name | fromJson).words) (has $text $r.tokenMethods)) -}}true{{- end -}}
  {{- end -}}
{{- end -}}
{{- end -}}

{{- /* torchrig.mapContext: the context a map under key "key" is judged in. Args: dict "key" "ctx" "rules". */ -}}
{{- define "torchrig.mapContext" -}}
{{- if and (has .key .rules.nameMaps) (eq .ctx "general") -}}names
{{- else if has .key .rules.envMaps -}}env
{{- else if eq .key "options" -}}options
{{- else -}}{{ .ctx }}
{{- end -}}
{{- end -}}

{{- /* torchrig.secretsInData: findings in plain data (a free-form map, list or text). Args: dict "node" "path" "ctx" "rules". */ -}}
{{- define "torchrig.secretsInData" -}}
{{- $found := list -}}
{{- if kindIs "string" .node -}}
  {{- $what := include "torchrig.credentialShape" (dict "text" .node "rules" .rules) -}}
  {{- if $what -}}{{- $found = append $found (list .path $what) -}}{{- end -}}
{{- else if kindIs "map" .node -}}
  {{- range $f := (include "torchrig.secretsInMap" . | fromJson).found -}}{{- $found = append $found $f -}}{{- end -}}
{{- else if kindIs "slice" .node -}}
  {{- range $i, $item := .node -}}
    {{- range $f := (include "torchrig.secretsInData" (dict "node" $item "path" (printf "%s[%d]" $.path $i) "ctx" $.ctx "rules" $.rules) | fromJson).found -}}{{- $found = append $found $f -}}{{- end -}}
  {{- end -}}
{{- end -}}
{{- toJson (dict "found" $found) -}}
{{- end -}}

{{- /* torchrig.secretsInMap: findings among a free-form map's keys and values. Args: dict "node" "path" "ctx" "rules". */ -}}
{{- define "torchrig.secretsInMap" -}}
{{- $r := .rules -}}
{{- $found := list -}}
{{- $accessKey := false -}}
{{- range $v := .node -}}
  {{- if and (kindIs "string" $v) (regexMatch (index (index $r.shapes 0) 1) $v) -}}{{- $accessKey = true -}}{{- end -}}
{{- end -}}
{{- range $key, $value := .node -}}
  {{- $keyShape := include "torchrig.credentialShape" (dict "text" $key "rules" $r) -}}
  {{- $where := "" -}}
  {{- if $keyShape -}}
    {{- $where = printf "%s[<redacted>]" $.path -}}
    {{- $found = append $found (list $where (printf "a map key that looks like %s" $keyShape)) -}}
  {{- else if regexMatch (printf "^(?:%s)$" $r.plainKey) $key -}}
    {{- $where = printf "%s.%s" $.path $key -}}
  {{- else if and (contains "'" $key) (not (contains "\"" $key)) -}}
    {{- $where = printf "%s[\"%s\"]" $.path $key -}}
  {{- else -}}
    {{- $where = printf "%s['%s']" $.path $key -}}
  {{- end -}}
  {{- if or (kindIs "map" $value) (kindIs "slice" $value) -}}
    {{- $ctx := include "torchrig.mapContext" (dict "key" $key "ctx" $.ctx "rules" $r) -}}
    {{- range $f := (include "torchrig.secretsInData" (dict "node" $value "path" $where "ctx" $ctx "rules" $r) | fromJson).found -}}{{- $found = append $found $f -}}{{- end -}}
  {{- else -}}
    {{- $what := "" -}}
    {{- if kindIs "string" $value -}}{{- $what = include "torchrig.credentialShape" (dict "text" $value "rules" $r) -}}{{- end -}}
    {{- if and (not $what) $accessKey (kindIs "string" $value) (regexMatch $r.awsSecretKey (trim $value)) -}}
      {{- $what = "an AWS secret access key (beside an access key id)" -}}
    {{- end -}}
    {{- if and (not $what) (include "torchrig.nameSaysSecret" (dict "name" $key "ctx" $.ctx "rules" $r)) (include "torchrig.holdsSecretValue" (dict "value" $value "name" $key "ctx" $.ctx "rules" $r)) -}}
      {{- $what = "a value named like a credential" -}}
    {{- end -}}
    {{- if $what -}}{{- $found = append $found (list $where $what) -}}{{- end -}}
  {{- end -}}
{{- end -}}
{{- toJson (dict "found" $found) -}}
{{- end -}}

{{- /* torchrig.secretsInModel: findings in one model level (its sub-models by the model's shape). Args: dict "node" "path" "shape" "rules". */ -}}
{{- define "torchrig.secretsInModel" -}}
{{- $found := list -}}
{{- range $key, $value := .node -}}
  {{- $where := ternary (printf "%s.%s" $.path $key) $key (ne $.path "") -}}
  {{- if and (kindIs "map" $value) (hasKey $.shape.models $key) -}}
    {{- range $f := (include "torchrig.secretsInModel" (dict "node" $value "path" $where "shape" (get $.shape.models $key) "rules" $.rules) | fromJson).found -}}{{- $found = append $found $f -}}{{- end -}}
  {{- else if kindIs "map" $value -}}
    {{- $ctx := include "torchrig.mapContext" (dict "key" $key "ctx" "general" "rules" $.rules) -}}
    {{- range $f := (include "torchrig.secretsInMap" (dict "node" $value "path" $where "ctx" $ctx "rules" $.rules) | fromJson).found -}}{{- $found = append $found $f -}}{{- end -}}
  {{- else if kindIs "slice" $value -}}
    {{- range $i, $item := $value -}}
      {{- $at := printf "%s[%d]" $where $i -}}
      {{- if and (kindIs "map" $item) (hasKey $.shape.lists $key) -}}
        {{- range $f := (include "torchrig.secretsInModel" (dict "node" $item "path" $at "shape" (get $.shape.lists $key) "rules" $.rules) | fromJson).found -}}{{- $found = append $found $f -}}{{- end -}}
      {{- else -}}
        {{- range $f := (include "torchrig.secretsInData" (dict "node" $item "path" $at "ctx" "general" "rules" $.rules) | fromJson).found -}}{{- $found = append $found $f -}}{{- end -}}
      {{- end -}}
    {{- end -}}
  {{- else if kindIs "string" $value -}}
    {{- $what := include "torchrig.credentialShape" (dict "text" $value "rules" $.rules) -}}
    {{- if $what -}}{{- $found = append $found (list $where $what) -}}{{- end -}}
  {{- end -}}
{{- end -}}
{{- toJson (dict "found" $found) -}}
{{- end -}}

{{- /* torchrig.inlineSecretChecks: fails with the loader's one-line refusal for the first inline credential of the job. Arg: dict "job" "root". */ -}}
{{- define "torchrig.inlineSecretChecks" -}}
{{- $rules := include "torchrig.credentialRules" .root | fromJson -}}
{{- $shape := include "torchrig.modelShape" .root | fromJson -}}
{{- $found := (include "torchrig.secretsInModel" (dict "node" .job "path" "" "shape" $shape "rules" $rules) | fromJson).found -}}
{{- if $found -}}
  {{- $path := index (first $found) 0 -}}
  {{- $alt := $rules.alternatives.other -}}
  {{- $store := regexFind "^spec\\.checkpoint\\.stores\\[[0-9]+\\]" $path -}}
  {{- if $store -}}{{- $alt = replace "@STORE@" $store $rules.alternatives.store -}}
  {{- else if hasPrefix "spec.checkpoint.initFrom" $path -}}{{- $alt = $rules.alternatives.initFrom -}}
  {{- else if hasPrefix "spec.ray." $path -}}{{- $alt = $rules.alternatives.ray -}}
  {{- end -}}
  {{- fail ($rules.error | replace "@PATH@" $path | replace "@WHAT@" (index (first $found) 1) | replace "@ALT@" $alt) -}}
{{- end -}}
{{- end -}}
