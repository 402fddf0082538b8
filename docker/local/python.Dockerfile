# Stand-in for python:3.11-slim-bookworm, built by scripts/compose-images.sh from
# Debian's own packages on a debootstrap base, for machines that reach no image
# registry. Debian bookworm's python3 is 3.11; `python` is python-is-python3;
# python3-dev: the headers the official image carries (torch.compile's C++
# kernels include them).
ARG BASE_IMAGE=llmpipe-local/debian:bookworm
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip python3-dev python-is-python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
