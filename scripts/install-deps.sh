#!/usr/bin/env bash
# Installs what rolloutd needs to build and test, idempotently: Debian packages for the C build
# (libmicrohttpd, jansson, libuv, ISA-L for CRC-32C, PCRE2 and utf8proc for the tokenizer,
# pkg-config; clang + its fuzzer runtime for `make fuzz`; wrk and curl for scripts/bench_http.sh;
# python3-venv: tests/e2e/test_router.py pip-installs sglang-router into a venv under build/;
# qemu-user: tests/e2e/test_cpu_models.py runs the daemon as other CPU models)
# and the Python packages the tests use (the official openai client among them:
# tests/e2e/test_openai.py drives /v1/completions through it; crc32c: the client's manifest
# checksums; `tokenizers` is the reference tests/e2e/test_tokenizer_hf.py checks rolloutd's
# tokenizer against).
# Safe to run again: it only installs what is missing.
set -euo pipefail

debs=(build-essential pkg-config libmicrohttpd-dev libjansson-dev libuv1-dev libisal-dev libpcre2-dev libutf8proc-dev clang libclang-rt-14-dev wrk curl python3-venv qemu-user)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
pymods=(pytest xdist numpy requests openai ml_dtypes crc32c tokenizers)
pypkgs=(pytest pytest-xdist numpy requests openai ml_dtypes crc32c tokenizers)
need=()
for i in "${!pymods[@]}"; do
  "$PY" -c "import ${pymods[$i]}" 2>/dev/null || need+=("${pypkgs[$i]}")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "install-deps: pip install ${need[*]}"
  "$PY" -m pip install -q "${need[@]}"
fi
echo "install-deps: ok"
