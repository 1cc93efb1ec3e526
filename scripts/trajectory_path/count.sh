#!/usr/bin/env bash
# The trajectory path, counted (issue 24): every jetctl function that takes or returns a
# trajectory's data, from the agent's model call to `optimizer.step()`, for the quickstart's
# configuration (hf on CPU, LoRA, one turn, G=8, merge: tree, grpo, nothing fails). The
# functions are listed in call order, one stage a file (stage1: agent call -> proxy ->
# Generate -> engine -> reply; stage2: rollout end -> group -> spool -> Submit -> admission ->
# store; stage3: the trainer gathers -> the step -> optimizer step), as "FILE FUNCTION
# [CLASS]". Left out: loop drivers, control-only code, the engine's KV-tensor helpers,
# metrics, costs, tracing and code that runs only on errors or in other configurations.
# Returns: every `return` statement in a function's body, nested defs included.
# Files: distinct files; hops: functions listed; a function in two stages counts once.
# Usage: scripts/trajectory_path/count.sh [REV]   (default HEAD; the lists were made at
# the commit after 16cd2ff: at another commit a renamed or moved function prints NOTFOUND)
set -euo pipefail
rev=${1:-HEAD}
here=$(dirname "$0")
cd "$here/../.."
count_one() {  # FILE FUNCTION [CLASS] -> "file<TAB>[Class.]function<TAB>returns<TAB>@line"
  git show "$rev:$1" 2>/dev/null | awk -v fn="$2" -v cls="${3:-}" -v file="$1" '
  function indent(s) { match(s, /^ */); return RLENGTH }
  {
    line = $0
    if (cls != "" && line ~ "^class " cls "[(:]") { incls = 1; next }
    if (cls != "" && incls && line ~ /^[^ #]/ && !found) incls = 0
    if (!found && (cls == "" || incls) && line ~ "^ *(async )?def " fn "\\(") {
      found = 1; ind = indent(line); start = NR; n = 0; next
    }
    if (found && !done) {
      if (line ~ /^ *$/) next
      if (indent(line) <= ind && line !~ /^ *[)\]]/ && line !~ /^ *#/) { done = 1; next }
      if (line ~ /^ *return([ (]|$)/) n++
    }
  }
  END {
    name = (cls != "" ? cls "." : "") fn
    if (found) printf "%s\t%s\t%d\t@%d\n", file, name, n, start
    else printf "%s\t%s\tNOTFOUND\n", file, name
  }'
}
for stage in 1 2 3; do
  echo "== stage $stage"
  while read -r file fn cls; do
    [ -n "$file" ] && count_one "$file" "$fn" "${cls:-}"
  done < "$here/stage$stage.txt"
done | tee /dev/stderr | awk -F'\t' '
  /^== / { next }
  $3 == "NOTFOUND" { missing++; next }
  !(($1, $2) in seen) { seen[$1, $2] = 1; hops++; returns += $3; files[$1] = 1 }
  END {
    for (f in files) nfiles++
    printf "whole path, each function once: %d files / %d hops / %d returns%s\n", nfiles,
      hops, returns, (missing ? " (" missing " NOTFOUND)" : "")
  }'
