#!/usr/bin/env bash
# Checks the include graph against the layer table of docs/design.md ("Folders and layers"):
# every #include "..." of a C, CUDA or header file under a module folder must name a header of
# the same folder or of a folder that table allows. Prints each violation as
#   file:line: <folder> may not include <target folder> (<header>)
# Outside kernels/, only kernels/*.h (not cpu/, cuda/ or the private op table backend_impl.h) may be
# included. Exits 1 if there is any violation, else prints a one-line summary and exits 0. Tests, tools, scripts
# and examples may include anything and are not checked. Also checks that no header outside
# kernels/cuda/ tests RS_CUDA (see the end). Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

# folder -> the folders it may include besides itself (keep in step with docs/design.md)
declare -A allow=(
  [core]=""
  [config]="core"
  [tokenizer]="core"
  [kernels]="core"
  [kvcache]="core kernels"
  [model]="core kernels kvcache"
  [scheduler]="core kernels kvcache model"
  [sync]="core kernels kvcache model scheduler"
  [protocol]="core config tokenizer kernels scheduler sync"
  [server]="core config tokenizer kernels kvcache model scheduler sync protocol"
)

bad=0 files=0 edges=0
while IFS= read -r f; do
  top=${f%%/*}
  [ -n "${allow[$top]+x}" ] || continue
  files=$((files + 1))
  dir=$(dirname "$f")
  while IFS=: read -r line inc; do
    [ -n "$inc" ] || continue
    target=$(realpath -m --relative-to=. "$dir/$inc")
    ttop=${target%%/*}
    edges=$((edges + 1))
    [ "$ttop" = "$top" ] && continue
    case " ${allow[$top]} " in
      *" $ttop "*) ;;
      *) echo "$f:$line: $top may not include $ttop ($inc)"; bad=$((bad + 1)) ;;
    esac
    # kernels/ is reached through its public headers only: not kernels/cpu/, kernels/cuda/, and
    # not the private op table (kernels/backend_impl.h)
    if [ "$top" != kernels ] && [ "$ttop" = kernels ]; then
      case "$target" in
        kernels/backend_impl.h|kernels/*/*) echo "$f:$line: $top may not include kernels' private $target"; bad=$((bad + 1)) ;;
      esac
    fi
  done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"' "$f" | sed -E 's/^([0-9]+):[^"]*"([^"]+)".*/\1:\2/')
done < <(git ls-files '*.c' '*.h' '*.cu' '*.cuh')

if [ "$bad" -gt 0 ]; then
  echo "check_layers: $bad include(s) break the layer table in docs/design.md"
  exit 1
fi

# A header reads the same in the CPU and the CUDA build: only .c files test RS_CUDA (the Makefile
# recompiles just those when CUDA= changes, so a header that tested it would mix two layouts of
# one type, or two sets of inline code, in one program). kernels/cuda/ is compiled by nvcc only.
cuda_if=$(git ls-files '*.h' | grep -v '^kernels/cuda/' | xargs grep -nE '^[[:space:]]*#[[:space:]]*(if|ifdef|ifndef|elif).*\<RS_CUDA\>' || true)
if [ -n "$cuda_if" ]; then
  echo "$cuda_if"
  echo "check_layers: headers test RS_CUDA (only .c files may: see the Makefile's CUDA_AWARE_OBJ)"
  exit 1
fi
echo "check_layers: ok ($files files, $edges includes)"
