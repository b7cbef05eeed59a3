#!/usr/bin/env bash
# What the test suite needs beyond pip, on a fresh machine (the README's test command runs it):
#
#   bash tests/setup.sh
#
# - a one-node Slurm for tests/test_slurm.py (tests/slurm/setup.sh);
# - Debian's headless chromium, which tests/test_analysis_stage.py opens the analysis report in;
# - pyCOLA's own environment (numpy<2, pycola3 0.0.7; needs PyPI and a C compiler) for
#   tests/test_pycola.py: python -m simulations.pycola_backend setup (README, "The pyCOLA
#   backend"); if it fails here, the tests' fixture tries again and fails naming the cause.
#
# As root with apt it installs what is missing (and starts Slurm's daemons; stop them with
# tests/slurm/stop.sh); elsewhere each part prints one line saying why it is unavailable and the
# tests that need it skip. It never fails: the tests report what is missing.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"

bash "$HERE/slurm/setup.sh"

if command -v chromium >/dev/null 2>&1; then
    echo "browser-setup: ready ($(chromium --version 2>/dev/null | head -n 1))"
elif [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "browser-setup: unavailable: chromium is not installed and this is not root with apt-get"
else
    export DEBIAN_FRONTEND=noninteractive
    if { apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 ||
         { apt-get update -q >/dev/null 2>&1 &&
           apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; }; then
        echo "browser-setup: ready ($(chromium --version 2>/dev/null | head -n 1))"
    else
        echo "browser-setup: unavailable: apt-get install chromium failed"
    fi
fi
if "${PYTHON:-python}" -m simulations.pycola_backend setup >/dev/null 2>&1; then
    echo "pycola-setup: ready ($("${PYTHON:-python}" -m simulations.pycola_backend check))"
else
    echo "pycola-setup: unavailable: python -m simulations.pycola_backend setup failed (run it to see why)"
fi
exit 0
