#!/usr/bin/env bash
# Create .venv and install everything: torch for this machine (the small CPU build unless an NVIDIA GPU is
# present: a plain `pip install torch` on Linux fetches a multi-GB CUDA build), then the pinned requirements.
#   bash scripts/setup.sh            # TORCH_VERSION=2.13.0 by default; VENV=.venv
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q "torch==$TORCH_VERSION"
else  # the CPU wheel from PyTorch's own index; its dependencies come from PyPI with the requirements below
    pip install -q --no-deps --retries 2 "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi
pip install -q -r requirements.txt -r requirements-dev.txt
echo "ready: $VENV ($("$VENV/bin/python" -c 'import torch, accelerate; print(f"torch {torch.__version__}, accelerate {accelerate.__version__}")')); activate it with: source $VENV/bin/activate"
