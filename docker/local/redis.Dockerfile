# Stand-in for redis:7, built by scripts/compose-images.sh from Debian's
# redis-server (7.0 in bookworm). Like the official image: data in /data (the
# `redis-data` volume takes its ownership), run as the `redis` user, no entrypoint
# of its own (docker-compose.yml's command starts redis-server).
ARG BASE_IMAGE=llmpipe-local/debian:bookworm
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
