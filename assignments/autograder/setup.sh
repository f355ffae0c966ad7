#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image from the unpacked archive in
# /autograder/source. It installs the repository's pinned requirements (source/repo/requirements.txt, the
# same file students install from) into a virtual environment, /autograder/venv, which run_autograder uses.
# Choose the Ubuntu 24.04 base image: the pins (numpy, matplotlib) need Python 3.11 or later.
set -euxo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"
REQUIREMENTS="$ROOT/source/repo/requirements.txt"

apt-get update
apt-get install -y --no-install-recommends python3 python3-venv python3-pip
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "setup.sh: $(python3 --version) is too old: the pinned requirements need 3.11 (Ubuntu 24.04)"; exit 1; }

# a venv, because the system Python of recent images refuses pip installs (PEP 668)
python3 -m venv "$ROOT/venv"
PIP="$ROOT/venv/bin/pip"
"$PIP" install --upgrade pip
# torch first, from its CPU index, at the version requirements.txt pins: the CPU build is all the graders use
# and a fraction of the default (CUDA) download; the next line then finds torch already satisfied
"$PIP" install "$(grep -E '^torch==' "$REQUIREMENTS")" --index-url https://download.pytorch.org/whl/cpu
"$PIP" install -r "$REQUIREMENTS"
