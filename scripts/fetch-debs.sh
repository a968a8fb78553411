#!/usr/bin/env bash
# Downloads the Debian packages of rolloutd's C dependencies (libmicrohttpd, jansson, libuv, ISA-L,
# PCRE2, utf8proc; runtime and -dev) into .debs/ (git-ignored), for a GPU machine that cannot install
# them itself (no network). Copy .debs/ to that machine with the checkout; scripts/gpu-check.sh
# unpacks them into .debs/root and points the compiler and loader there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .debs
cd .debs
apt-get download libmicrohttpd12 libmicrohttpd-dev libjansson4 libjansson-dev libuv1 libuv1-dev \
  libisal2 libisal-dev libpcre2-8-0 libpcre2-dev libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 libutf8proc2 libutf8proc-dev
ls -l ./*.deb
