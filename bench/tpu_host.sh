#!/usr/bin/env bash
# The TPU-host bench (issue 32), for any user of a TPU VM:
#
#   bench/tpu_host.sh [OUT_DIR]        # or OUT=DIR bench/tpu_host.sh
#
# Installs ckpt (and what the host's python lacks of its dependencies and
# orbax-checkpoint's) into OUT_DIR/site with the host's pip, never over the
# host's own jax: the target is put at the END of the path, after the host's
# packages. Then bench/tpu_host.py writes a checkpoint from the chip with the
# host's orbax, runs ckpt inspect/validate/reshard/convert on it, restores every
# output with orbax onto the chip and compares bytes, times the floors, and
# prints one table (also OUT_DIR/table.txt and OUT_DIR/results.json). Exit 1
# if any step fails or any byte differs.
#
# Variables:
#   PYTHON=python3          the host's python (its jax, and orbax if it has one)
#   INDEX=URL               package index (default file:///opt/pypi/simple where it exists, else pip's own)
#   WHEELS=DIR              a folder of wheels for what the index lacks (pip --find-links)
#   INSTALL=0               use this checkout and the python's packages as they are (no pip)
#   TPU_HOST_BENCH_PLATFORM=cpu SIZE=small   the whole run on 8 CPU devices, a few MiB (debugging)
#   WORK=DIR                scratch for the checkpoints (default OUT_DIR/work; removed on success unless KEEP_WORK=1)
#   MODE=profile            where the time of the slow steps goes, instead of the table (OUT_DIR/profile.tgz)
#   MODE=ab AB_TREE=DIR     this ckpt against the ckpt_tool package under DIR, interleaved (OUT_DIR/ab.txt);
#                           STEPS=convert_dcp,reshard_host,reshard_v5e8,reshard_v5e256 picks its steps
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mkdir -p "${1:-${OUT:-$PWD/tpu_host_bench}}" && cd "${1:-${OUT:-$PWD/tpu_host_bench}}" && pwd)
PYTHON=${PYTHON:-python3}
export TPU_HOST_BENCH_PLATFORM=${TPU_HOST_BENCH_PLATFORM:-tpu} SIZE=${SIZE:-full}

if [[ ${INSTALL:-1} == 0 ]]; then
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO"
else
  SITE=$OUT/site
  rm -rf "$SITE" && mkdir -p "$SITE"
  if [[ -z ${INDEX:-} && -d /opt/pypi/simple ]]; then INDEX=file:///opt/pypi/simple; fi
  pip_install() {  # the host's pip, isolated from user config; binaries only
    PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install --isolated --quiet --disable-pip-version-check \
      --only-binary=:all: ${INDEX:+--index-url "$INDEX"} ${WHEELS:+--find-links "$WHEELS"} \
      --no-deps --target "$SITE" "$@"
  }
  # ckpt itself: a wheel built from this checkout, with the host's setuptools where it can (it needs
  # `wheel` too below setuptools 70.1), else in pip's isolated build environment from the index
  build_wheel() {
    PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip wheel --isolated --quiet --disable-pip-version-check --no-deps \
      --wheel-dir "$OUT/wheel" "$@" "$REPO"
  }
  rm -rf "$OUT/wheel"
  build_wheel --no-build-isolation 2>/dev/null ||
    build_wheel --only-binary=:all: ${INDEX:+--index-url "$INDEX"} ${WHEELS:+--find-links "$WHEELS"}
  pip_install "$OUT"/wheel/ckpt*.whl
  # then what the host lacks, requirement by requirement: the host's installed jax
  # (and numpy, ...) are kept, whatever version pip's resolver would have picked
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE"
  for _ in $(seq 1 10); do
    missing=$("$PYTHON" "$REPO/bench/tpu_host.py" missing ckpt-tool orbax-checkpoint)
    [[ -z $missing ]] && break
    echo "installing into $SITE: $missing" >&2
    set -f  # one argument per requirement; 'etils[epath]' is not a glob
    # shellcheck disable=SC2086
    if ! pip_install $missing 2>/dev/null; then
      failed=""  # one by one, to name exactly what neither the index nor WHEELS has
      for req in $missing; do pip_install "$req" 2>/dev/null || failed="$failed $req"; done
      if [[ -n $failed ]]; then
        echo "pip found no wheel for:$failed (index ${INDEX:-the default}${WHEELS:+, wheels $WHEELS}). Download" \
             "them where an index is reachable (pip download --only-binary=:all: --no-deps --python-version" \
             "$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])') -d DIR ...) and pass WHEELS=DIR" >&2
        exit 1
      fi
    fi
    set +f
  done
  if [[ -n $missing ]]; then echo "still missing after 10 rounds: $missing" >&2; exit 1; fi
  # the bench's python helper runs from this checkout; ckpt from the install
fi

exec "$PYTHON" "$REPO/bench/tpu_host.py" "$OUT"
