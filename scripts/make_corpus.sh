#!/usr/bin/env bash
# Writes a reproducible English text corpus for `k3 tokenizer train` tests and benchmarks.
#
#   scripts/make_corpus.sh OUT_FILE [MB]     (MB: megabytes of 10^6 bytes, default 10, at most 18)
#
# Sources, in this order, files sorted by name in the C locale:
#   1. Vim's help files, /usr/share/vim/vim9*/doc/*.txt (package vim-runtime, 9.5 MB of prose);
#   2. Perl's manual pages, /usr/share/perl/5.*/pod/*.pod (package perl-doc, 9.1 MB of POD).
# Whole lines are taken until at least MB x 10^6 bytes are written, so the output is the same
# bytes wherever the same package versions are installed; the script prints them and the sha256.
# Missing packages are installed with apt-get (as scripts/setup.sh does).
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 OUT_FILE [MB]" >&2
  exit 2
fi
OUT=$1
MB=${2:-10}
if ! [[ "$MB" =~ ^[0-9]+$ ]] || [ "$MB" -lt 1 ]; then
  echo "error: MB must be a positive integer, got '$MB'" >&2
  exit 2
fi
BYTES=$((MB * 1000000))

PKGS=(vim-runtime perl-doc)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "make_corpus: installing ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

export LC_ALL=C
shopt -s nullglob
# Directories resolved and deduplicated (/usr/share/perl/5.36 is a link to 5.36.0).
mapfile -t dirs < <(for d in /usr/share/vim/vim9*/doc /usr/share/perl/5.*/pod; do readlink -f "$d"; done | awk '!seen[$0]++')
files=()
for d in "${dirs[@]}"; do
  case "$d" in */vim*) ext=txt ;; *) ext=pod ;; esac
  mapfile -t -O "${#files[@]}" files < <(printf '%s\n' "$d"/*."$ext" | sort)
done
if [ ${#files[@]} -eq 0 ]; then
  echo "error: no source files found under /usr/share/vim/vim9*/doc or /usr/share/perl/5.*/pod" >&2
  exit 1
fi
available=$(cat "${files[@]}" | wc -c)
if [ "$available" -lt "$BYTES" ]; then
  echo "error: the sources hold $available bytes, fewer than the $BYTES requested (MB=$MB)" >&2
  exit 1
fi

tmp="$OUT.tmp.$$"
trap 'rm -f "$tmp"' EXIT
awk -v n="$BYTES" '{ print; s += length($0) + 1; if (s >= n) exit }' "${files[@]}" > "$tmp"
mv "$tmp" "$OUT"
trap - EXIT

echo "make_corpus: wrote $(wc -c < "$OUT") bytes to $OUT" >&2
for p in "${PKGS[@]}"; do echo "make_corpus: $p $(dpkg-query -W -f='${Version}' "$p")" >&2; done
echo "make_corpus: sha256 $(sha256sum "$OUT" | cut -d' ' -f1)" >&2
