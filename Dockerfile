# The image the GKE manifests run (`gke.image` in configs/gke-*.yaml): simloop with its `[tpu]`
# extra (jax[tpu] with libtpu, vllm-tpu) on Python 3.12, at the versions constraints.txt pins,
# the file `make` installs through too. Build and push (docs/tpu-gke.md, "The image"):
#
#   docker build --platform linux/amd64 -t us-docker.pkg.dev/MY_PROJECT/simloop/simloop:latest .
#   docker push us-docker.pkg.dev/MY_PROJECT/simloop/simloop:latest
#
# Bookworm because the image's pins were resolved for its glibc (2.36) on x86_64, the TPU hosts'.
FROM python:3.12-slim-bookworm

# What the real shell environments call: bash and coreutils for the agent's commands,
# util-linux's unshare/setpriv/nsenter to isolate them, git and patch to grade swe-style tasks.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        bash coreutils util-linux git patch procps ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/simloop
COPY pyproject.toml README.md constraints.txt ./
COPY rl rl
COPY serving serving
COPY envs envs
COPY launch launch
COPY configs configs
# Not editable: the pods run the installed package, whatever their working directory.
RUN python -m pip install -q -c constraints.txt '.[tpu]' \
    && simloop --help > /dev/null

# The GKE pods override this with `python -m launch.deploy.gke_pod` (launch/deploy/gke.py);
# `docker run IMAGE train-agent --config ...` runs one job.
ENTRYPOINT ["simloop"]
CMD ["--help"]
