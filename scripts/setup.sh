#!/usr/bin/env bash
# Create .venv with torch for this machine (the small CPU build unless an NVIDIA GPU is present: a plain
# `pip install torch` on Linux fetches a multi-GB CUDA build) and what training needs (requirements.txt); with --dev
# also what the tests need: requirements-dev.txt, every optional feature's requirements/*.txt, and the programs in
# requirements/tools/ (each in a folder of its own).
#   bash scripts/setup.sh          # TORCH_VERSION=2.13.0 by default; VENV=.venv; PYTHON=python3 (3.11+)
#   bash scripts/setup.sh --dev    # + tests, lint and every feature present
# The installed torch is then pinned for every later `pip install` in the venv (docs/install.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
case "${1-}" in
    "") dev=false ;;
    --dev) dev=true ;;
    *) echo "error: unknown option '$1': use \`bash scripts/setup.sh\` or \`bash scripts/setup.sh --dev\`" >&2; exit 2 ;;
esac

# The pinned requirements (pyarrow 26, ...) are published for Python 3.11 and newer: refused now, not by pip later
python=$([ -x "$VENV/bin/python" ] && echo "$VENV/bin/python" || echo "${PYTHON:-python3}")
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    found=$("$python" -c 'import platform; print(platform.python_version())' 2>/dev/null) || found="not found"
    redo=$([ -x "$VENV/bin/python" ] && echo " (after removing $VENV, made with it)" || true)
    echo "error: Python 3.11 or newer is needed and $python is $found; run with one$redo:" \
        "PYTHON=python3.12 bash scripts/setup.sh" >&2
    exit 2
fi
[ -x "$VENV/bin/python" ] || "$python" -m venv "$VENV"
# --no-compile: a run compiles (and caches) what it imports, ~50 MB; compiling every installed file up front would add
# ~230 MB of __pycache__ to the training install (and, for --dev, ~40 s compiling 21,610 files the tests mostly never
# import: the test suite caches what it imports, even where PYTHONDONTWRITEBYTECODE is set: tests/conftest.py).
install() { "$VENV/bin/python" -m pip install -q --no-compile "$@"; }

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1; then
    install "torch==$TORCH_VERSION"
else  # the CPU wheel from PyTorch's own index; its dependencies come from PyPI with the requirements below
    install --no-deps --retries 2 "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi

# pip reads <venv>/pip.conf, so `.venv/bin/pip install timm` keeps this torch (or stops with a conflict) instead of
# replacing it with another build, e.g. the CPU one with a CUDA one and its nvidia-* libraries (GBs).
installed=$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("torch"))')
echo "torch==$installed" >"$VENV/constraints.txt"
printf '[install]\nconstraint = %s\n' "$(cd "$VENV" && pwd)/constraints.txt" >"$VENV/pip.conf"

requirements=(-r requirements.txt)
if $dev; then
    requirements+=(-r requirements-dev.txt)
    for file in requirements/*.txt; do [ -e "$file" ] && requirements+=(-r "$file"); done
fi
install "${requirements[@]}"
if $dev; then
    # Programs the tests start (requirements/tools/NAME.txt) go in .venv/tools/NAME, off the venv's path, so that the
    # runs never import their packages; reinstalled only when the file changed (a copy of it is kept there).
    for file in requirements/tools/*.txt; do
        folder="$VENV/tools/$(basename "$file" .txt)"
        [ ! -e "$file" ] || cmp -s "$file" "$folder/requirements.txt" || {
            rm -rf "$folder"
            install --target "$folder" --no-warn-conflicts -r "$file"
            cp "$file" "$folder/requirements.txt"
        }
    done
fi
echo "ready: $VENV ($("$VENV/bin/python" -c 'import torch, accelerate; print(f"torch {torch.__version__}, accelerate {accelerate.__version__}")')); activate it with: source $VENV/bin/activate"
